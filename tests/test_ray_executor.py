"""--executor ray on a local Ray instance gives the same output as the local executor (greedy float32),
and treats bad input rows the same way (`rejects.jsonl`, row errors, exit code)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from typer.testing import CliRunner

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import batchinfer  # noqa: E402
from batchinfer.cli import app  # noqa: E402
from batchinfer.io import layout  # noqa: E402

N_ROWS = 24


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def write_inputs(tmp: Path) -> None:
    """Half the rows in a Parquet shard, half in JSONL (both Ray readers are used), in hive partition
    folders whose columns the template and keep_columns read."""
    rows = [{"doc_id": i, "text": f"invoice {i} total {i * 7} date {i % 13}", "title": f"T{i}"} for i in range(N_ROWS)]
    (tmp / "in" / "src=pq" / "year=2024").mkdir(parents=True)
    (tmp / "in" / "src=js" / "year=2025").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[: N_ROWS // 2]), tmp / "in" / "src=pq" / "year=2024" / "a.parquet")
    (tmp / "in" / "src=js" / "year=2025" / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[N_ROWS // 2:]))


def job(model: Path, tmp: Path, out: str, **over) -> dict:
    d = {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": str(tmp / "in"), "id_column": "doc_id"},
        "output": {"path": str(tmp / out), "keep_columns": ["title"], "rows_per_part": 5},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 6},
        "engine": {"max_num_seqs": 8, "device": "cpu", "num_kv_blocks": 96, "data_parallel": 1},
    }
    for k, v in over.items():
        d[k] = {**d[k], **v}
    return d


def test_ray_executor_matches_local_and_resumes(tiny_model, tmp_path, local_ray):
    write_inputs(tmp_path)
    hive = {"output": {"keep_columns": ["title", "src", "year"]}, "prompt": {"template": "{{ src }} {{ year }}: {{ text }}"}}
    local = batchinfer.run(job(tiny_model, tmp_path, "local", **hive))
    # resume through the same manifest: a first local run did some rows, Ray does the rest
    first = job(tiny_model, tmp_path, "ray", **hive)
    first["input"]["path"] = str(tmp_path / "in" / "**" / "*.parquet")
    batchinfer.run(first)
    seen = []
    summary = batchinfer.run(job(tiny_model, tmp_path, "ray", **hive), executor="ray", on_row=seen.append)
    assert summary.this_run_rows == N_ROWS // 2 and len(seen) == N_ROWS // 2 and summary.rows_done == N_ROWS
    a = pl.read_parquet(tmp_path / "local" / "*.parquet").sort("doc_id")
    b = pl.read_parquet(tmp_path / "ray" / "*.parquet").sort("doc_id")
    assert b["doc_id"].to_list() == list(range(N_ROWS))  # every id exactly once
    assert b.columns == a.columns and b.schema == a.schema
    cols = ["doc_id", "title", "src", "year", "output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
    assert a.select(cols).equals(b.select(cols))  # identical output_text per id (the prompts read the partitions)
    assert b.schema["year"] == pl.Int32 and b.filter(pl.col("doc_id") >= N_ROWS // 2)["src"].unique().to_list() == ["js"]
    assert json.loads(layout.manifest_path(tmp_path / "ray").read_text())["rows"] == N_ROWS
    assert local.this_run_rows == N_ROWS
    assert batchinfer.run(job(tiny_model, tmp_path, "ray", **hive), executor="ray").nothing_to_do



def write_bad_inputs(tmp: Path) -> None:
    """Good rows with every kind of bad line between them, in JSONL, JSONL.gz and Parquet (a null id)."""
    doc = lambda i: {"doc_id": i, "text": f"receipt {i} paid {i * 3}", "title": f"T{i}"}  # noqa: E731
    (tmp / "in").mkdir()
    pq.write_table(pa.Table.from_pylist([doc(0), {"doc_id": None, "text": "null id", "title": "N"}, doc(1)]), tmp / "in" / "a.parquet")
    lines = [json.dumps(doc(2)), "this is not json {", "[1, 2]", json.dumps({"text": "no id", "title": "x"}), "",
             json.dumps(doc(3)), json.dumps({"doc_id": None, "text": "null"}), json.dumps({"doc_id": 4, "title": "no text"}),
             '"just a string"', json.dumps({"doc_id": [5], "text": "list id"}), json.dumps(doc(6))]
    (tmp / "in" / "b.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(tmp / "in" / "c.jsonl.gz", "wt") as fh:
        fh.write(json.dumps(doc(7)) + "\nnot json either\n" + json.dumps(doc(8)) + "\n")


def test_ray_rejects_bad_lines_like_local(tiny_model, tmp_path, local_ray):
    write_bad_inputs(tmp_path)
    # the Ray run resumes a local one that did b.jsonl: its rows are finished, its rejects are listed again
    first = job(tiny_model, tmp_path, "ray")
    first["input"]["path"] = str(tmp_path / "in" / "b.jsonl")
    assert batchinfer.run(first).this_run_rows == 4
    runs = {}
    for name, executor in (("local", "local"), ("ray", "ray")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(job(tiny_model, tmp_path, name)))
        res = CliRunner().invoke(app, ["run", str(path), "--quiet", "--executor", executor])
        assert res.exception is None or isinstance(res.exception, SystemExit), res.output
        # the run finishes; the bad lines push the error rate over the default 0 -> exit 3, not 1
        assert res.exit_code == 3, res.output
        runs[name] = (res.exit_code, batchinfer.run(job(tiny_model, tmp_path, name), executor=executor))
    (lcode, local), (rcode, ray_s) = runs["local"], runs["ray"]
    assert rcode == lcode and ray_s.nothing_to_do
    assert (ray_s.rejects, ray_s.rows_done, ray_s.error_rows, ray_s.error_rate) == (local.rejects, local.rows_done, local.error_rows, local.error_rate)
    assert local.rejects == 8 and local.rows_done == 8 and local.error_rows == 1
    # the same rejects, in the same order: file, line, start of the line, reason
    lr = layout.rejects_path(tmp_path / "local").read_text()
    assert layout.rejects_path(tmp_path / "ray").read_text() == lr
    got = [(Path(r["file"]).name, r["line"], r["reason"]) for r in map(json.loads, lr.splitlines())]
    assert got == [
        ("a.parquet", 2, "id column 'doc_id' is null"),
        ("b.jsonl", 2, "not valid JSON: Expecting value"), ("b.jsonl", 3, "not a JSON object (a list)"),
        ("b.jsonl", 4, "id column 'doc_id' is missing"), ("b.jsonl", 7, "id column 'doc_id' is null"),
        ("b.jsonl", 9, "not a JSON object (a str)"), ("b.jsonl", 10, "id column 'doc_id' is not a scalar"),
        ("c.jsonl.gz", 2, "not valid JSON: Expecting value"),
    ]
    assert not layout.tmp_dir(tmp_path / "ray").files()  # the readers' per-file reject lists are gone
    cols = ["doc_id", "title", "output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
    a = pl.read_parquet(tmp_path / "local" / "*.parquet").sort("doc_id").select(cols)
    b = pl.read_parquet(tmp_path / "ray" / "*.parquet").sort("doc_id").select(cols)
    assert b["doc_id"].to_list() == [0, 1, 2, 3, 4, 6, 7, 8]  # every good id exactly once
    assert a.equals(b)  # identical output per id, the row error included (line number of row 4 too)
    assert "template column 'text' is missing" in b.filter(pl.col("doc_id") == 4)["error"].item()


def test_ray_openai_batch_file_matches_local(tiny_model, tmp_path, local_ray):
    """An OpenAI Batch file on Ray: the lines travel whole (url, body), a repeated custom_id is rejected,
    and results.jsonl / errors.jsonl answer every custom_id as the local executor does."""
    url = "/v1/chat/completions"
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": url,
                         "body": {"messages": [{"role": "user", "content": f"invoice {i}"}], "max_tokens": 2 + i % 3}})
             for i in range(6)]
    lines.append(json.dumps({"custom_id": "c1", "url": url, "body": {"messages": []}}))  # a repeat: rejected
    lines.append(json.dumps({"custom_id": "c9", "url": "/v1/embeddings", "body": {"messages": []}}))  # an error row
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "batch.jsonl").write_text("\n".join(lines) + "\n")

    def answers(out: str) -> dict:
        run = job(tiny_model, tmp_path, out)
        run["input"] = {"path": str(tmp_path / "in"), "format": "openai"}
        run["output"] = {"path": str(tmp_path / out), "format": "openai"}
        del run["prompt"]
        batchinfer.run(run, executor="ray" if out == "ray" else "local")
        got = {}
        for name, path in zip(("results.jsonl", "errors.jsonl"), layout.openai_paths(tmp_path / out)):
            for x in path.read_text().splitlines():
                r = json.loads(x)
                body = (r["response"] or {}).get("body", {})
                got[r["custom_id"]] = (name, [c["message"]["content"] for c in body.get("choices", [])], r["error"])
        return got

    local, on_ray = answers("local"), answers("ray")
    assert sorted(on_ray) == ["c0", "c1", "c2", "c3", "c4", "c5", "c9"] and on_ray == local
    assert on_ray["c9"][0] == "errors.jsonl"
    rejects = [json.loads(x) for x in layout.rejects_path(tmp_path / "ray").read_text().splitlines()]
    assert [(r["line"], r["reason"].split(" (")[0]) for r in rejects] == [(7, "duplicate custom_id 'c1'")]
