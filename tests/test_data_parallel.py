"""engine.data_parallel: CPU engine workers give the same rows as one engine; SIGKILLed workers lose
and duplicate nothing (their rows go to the others, or to the resumed run)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

import batchinfer
from batchinfer.job.executors.data_parallel import Coordinator, DataParallelPlan, _Worker, plan_data_parallel, sigkill_workers_after
from batchinfer.job.executors.parts import WorkerPartWriter
from batchinfer.io import layout
from batchinfer.io.readers import Row
from batchinfer.io.writer import output_schema
from batchinfer.job.spec import JobError, load_job
from batchinfer.job.plan import plan_inputs
from batchinfer.job import RunError
from batchinfer.job.results import result_columns

N_ROWS = 48


def write_input(tmp: Path) -> None:
    rows = [{"doc_id": i, "text": f"invoice {i} total {i * 7} date {i % 13}"} for i in range(N_ROWS)]
    rows[5] = {"doc_id": 5}  # no `text`: a template error row, written with its error
    lines = [json.dumps(r) for r in rows]
    lines.insert(10, "not json at all")  # a reject
    (tmp / "in.jsonl").write_text("\n".join(lines) + "\n")


def job(model: Path, tmp: Path, out: str, dp: int | str, **engine) -> dict:
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": str(tmp / "in.jsonl"), "id_column": "doc_id"},
        "output": {"path": str(tmp / out), "rows_per_part": 4},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 6},
        "engine": {"max_num_seqs": 8, "device": "cpu", "num_kv_blocks": 96, "data_parallel": dp, **engine},
    }


def read(out: Path) -> pl.DataFrame:
    return pl.read_parquet(out / "*.parquet").sort("doc_id")


def assert_exactly_once(out: Path) -> pl.DataFrame:
    df = read(out)
    assert df["doc_id"].to_list() == list(range(N_ROWS))
    assert json.loads(layout.manifest_path(out).read_text())["rows"] == N_ROWS
    assert [f.name for f in out.iterdir() if not f.name.startswith("part-")] == []
    assert not layout.tmp_dir(out).files()
    return df


def test_plan_workers():
    base = {"model": "m", "input": {"path": "a", "id_column": "i"}, "output": {"path": "o"}, "prompt": {"template": "t"}}
    spec = lambda **e: load_job({**base, "engine": e})  # noqa: E731
    assert plan_data_parallel(spec(data_parallel="auto"), gpus=[]).workers == 1
    assert plan_data_parallel(spec(data_parallel="auto"), gpus=["2", "5"]).gpus == ("2", "5")
    assert plan_data_parallel(spec(data_parallel="auto", device="cpu"), gpus=["0", "1"]).gpus is None
    cpu = plan_data_parallel(spec(data_parallel=3), gpus=[])
    assert cpu.workers == 3 and cpu.gpus is None
    assert plan_data_parallel(spec(data_parallel=2), gpus=["0", "1", "2"]).gpus == ("0", "1")
    with pytest.raises(JobError, match="data_parallel is 4 but only 2 GPU"):
        plan_data_parallel(spec(data_parallel=4), gpus=["0", "1"])
    with pytest.raises(JobError, match="no CUDA GPU"):
        plan_data_parallel(spec(data_parallel=2, device="cuda"), gpus=[])
    with pytest.raises(JobError, match="engine.data_parallel"):
        load_job({**base, "engine": {"data_parallel": 0}})


def test_executors_are_chosen_by_name(monkeypatch):
    """`local` is this host (one engine here unless engine.data_parallel asks for more), `data_parallel` always
    worker processes; every executor has the declared interface."""
    import torch

    from batchinfer.job.executors import EXECUTORS, executor_for
    from batchinfer.job.executors.base import Executor
    from batchinfer.job.executors.data_parallel import DataParallelExecutor
    from batchinfer.job.executors.local import LocalExecutor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a host without GPUs
    base = {"model": "m", "input": {"path": "a", "id_column": "i"}, "output": {"path": "o"}, "prompt": {"template": "t"}}
    spec = lambda **e: load_job({**base, "engine": {"device": "auto", **e}})  # noqa: E731
    assert isinstance(executor_for("local", spec()), LocalExecutor)
    assert isinstance(executor_for("local", spec(data_parallel="auto")), LocalExecutor)  # one CPU engine: no process
    two = executor_for("local", spec(data_parallel=2))
    assert isinstance(two, DataParallelExecutor) and two.dp.workers == 2
    one = executor_for("data_parallel", spec())
    assert isinstance(one, DataParallelExecutor) and one.dp.workers == 1
    assert set(EXECUTORS) == {"local", "data_parallel", "ray"}
    for ex in (LocalExecutor(), two):
        assert isinstance(ex, Executor) and ex.name in EXECUTORS
    with pytest.raises(JobError, match="--executor 'spark': use one of local, data_parallel, ray"):
        executor_for("spark", spec())


def test_two_workers_give_the_same_rows_as_one(tiny_model, tmp_path):
    write_input(tmp_path)
    one = batchinfer.run(job(tiny_model, tmp_path, "one", 1))
    seen = []
    two = batchinfer.run(job(tiny_model, tmp_path, "two", 2), on_row=seen.append)
    a, b = assert_exactly_once(tmp_path / "one"), assert_exactly_once(tmp_path / "two")
    cols = ["doc_id", "output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
    assert a.select(cols).equals(b.select(cols))  # greedy float32: identical answers per id
    assert b.filter(pl.col("doc_id") == 5)["error"][0] and b.schema["doc_id"] == pl.Int64
    assert layout.rejects_path(tmp_path / "one").read_text() == layout.rejects_path(tmp_path / "two").read_text() != ""
    assert two.this_run_rows == one.this_run_rows == N_ROWS and two.rejects == 1 and len(seen) == N_ROWS
    assert two.completion_tokens == one.completion_tokens
    assert json.loads(layout.manifest_path(tmp_path / "two").read_text())["rows"] == N_ROWS
    assert batchinfer.run(job(tiny_model, tmp_path, "two", 2)).nothing_to_do


def test_sigkill_one_worker_mid_run_its_rows_go_to_the_other(tiny_model, tmp_path):
    write_input(tmp_path)
    hook, killed = sigkill_workers_after(after_rows=6, how_many=1)
    summary = batchinfer.run(job(tiny_model, tmp_path, "out", 2), on_progress=hook)
    assert len(killed) == 1
    assert_exactly_once(tmp_path / "out")
    assert summary.this_run_rows == N_ROWS and summary.rows_done == N_ROWS


def test_sigkill_every_worker_then_resume_exactly_once(tiny_model, tmp_path):
    write_input(tmp_path)
    hook, killed = sigkill_workers_after(after_rows=6, how_many=2)
    with pytest.raises(RunError, match="all 2 engine workers died"):
        batchinfer.run(job(tiny_model, tmp_path, "out", 2), on_progress=hook)
    assert len(killed) == 2
    done = pl.read_parquet(tmp_path / "out" / "*.parquet")["doc_id"].to_list()
    assert len(done) == len(set(done)) < N_ROWS
    resumed = batchinfer.run(job(tiny_model, tmp_path, "out", 2))
    assert resumed.this_run_rows == N_ROWS - len(done)
    assert_exactly_once(tmp_path / "out")


class _DeadProcess:
    """The process handle of a worker that already died (what the driver sees after a SIGKILL)."""

    exitcode = -9

    def join(self, timeout=None) -> None:
        pass

    def is_alive(self) -> bool:
        return False


class _ClosedPipe:
    def poll(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_part_committed_but_not_reported_is_recorded_and_not_redone(tiny_model, tmp_path):
    """A worker renamed a part, then died before reporting it: the driver records it and re-queues the rest."""
    write_input(tmp_path)
    plan = plan_inputs(load_job(job(tiny_model, tmp_path, "out", 2)))
    try:
        columns = output_schema(plan.key_types, result_columns(None, 1, False))
        rows = [Row({"doc_id": i, "text": f"t{i}"}, "in.jsonl", i + 1) for i in range(6)]
        coord = Coordinator(plan, DataParallelPlan(2, None, 3), columns, iter(()), None, lambda spec: None)
        w = _Worker(0, _DeadProcess(), _ClosedPipe(), _ClosedPipe())
        w.outstanding = {str(r.values["doc_id"]): r for r in rows}
        coord.workers = [w]
        reported = []
        writer = WorkerPartWriter(plan.output_dir, plan.manifest.fingerprint, "doc_id", columns, 100, 60.0,
                                  lambda: 7, lambda part, ids: reported.append((part, ids)))
        for r in rows[:4]:  # the worker finished 4 of its 6 rows and committed them
            writer.add({"doc_id": r.values["doc_id"], "output_text": "x", "finish_reason": "stop",
                        "prompt_tokens": 1, "completion_tokens": 1, "error": None})
        writer.close()
        assert reported and reported[0][0].name == "part-000007.parquet" and reported[0][1] == ["0", "1", "2", "3"]
        coord._lost(w, "killed")  # ... and the report never reached the driver
        assert [p.name for p in plan.manifest.parts] == ["part-000007.parquet"]
        assert [r.values["doc_id"] for r in coord.backlog] == [4, 5]  # only the uncommitted rows are done again
        assert coord.outcome.rows == 4 and coord.outcome.worker_deaths == 1 and not w.outstanding
    finally:
        plan.close()


def test_unknown_executor_is_a_user_error(tmp_path):
    from typer.testing import CliRunner

    from batchinfer.cli import app

    (tmp_path / "job.yaml").write_text("model: m\ninput: {path: x, id_column: i}\noutput: {path: o}\nprompt: {template: t}\n")
    res = CliRunner().invoke(app, ["run", str(tmp_path / "job.yaml"), "--executor", "spark"])
    assert res.exit_code == 2 and "--executor" in res.output


def test_bench_aggregate_of_engines_that_ran_together():
    from batchinfer.bench.report_text import format_report
    from batchinfer.bench.throughput import aggregate_data_parallel

    def part(out, elapsed, floor_s):
        return {"workload": "w", "description": "d", "model": "m", "device": "cuda", "dtype": "bfloat16", "requests": 10,
                "errors": 0, "prompt_tokens": 100, "output_tokens": out, "elapsed_s": elapsed, "load_s": 1.0,
                "output_tokens_per_s": out / elapsed, "ceilings": {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0},
                "floor": {"floor_s": floor_s, "bound": "memory", "compute_s": 0.1, "memory_s": floor_s, "concurrency": 10,
                          "min_steps": 5}, "floor_output_tokens_per_s": out / floor_s, "fraction_of_roofline": floor_s / elapsed,
                "steps": 5, "decode_steps": 4}

    r = aggregate_data_parallel([part(1000, 2.0, 0.5), part(800, 4.0, 0.4)])
    assert r["data_parallel"] == 2 and r["output_tokens"] == 1800 and r["elapsed_s"] == 4.0
    assert r["output_tokens_per_s"] == 450.0 and r["floor_output_tokens_per_s"] == 1800 / 0.5
    assert r["floor_x_n_output_tokens_per_s"] == 2000 + 2000 and r["fraction_of_roofline"] == 0.5 / 4.0
    assert "data parallel: 2 engines" in format_report(r)
