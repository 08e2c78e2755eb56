"""The job driver against the real engine with a tiny random model (in-process, one shared engine)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchinfer
from batchinfer.io import layout
from batchinfer.io.readers import InputError
from batchinfer.job.spec import JobError
from batchinfer.job import run_job as run
from failing_engine import FailingEngine

WORDS = "invoice total date customer alpha beta gamma one two three".split()



def docs(n: int, start: int = 0) -> list[dict]:
    return [{"doc_id": i, "text": " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(6)), "title": f"T{i}"} for i in range(start, start + n)]


def job(model_dir: Path, tmp: Path, input_path: str, **over) -> dict:
    d = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "input": {"path": input_path, "id_column": "doc_id"},
        "output": {"path": str(tmp / "out"), "keep_columns": ["title"], "rows_per_part": 7},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 4},
        "engine": {"max_num_seqs": 8, "device": "cpu", "num_kv_blocks": 64},
    }
    for k, v in over.items():
        d[k] = {**d[k], **v} if isinstance(v, dict) and isinstance(d.get(k), dict) else v
    return d


def read_out(tmp: Path) -> pl.DataFrame:
    return pl.read_parquet(tmp / "out" / "*.parquet")


def test_parquet_shards_glob_exactly_once(tiny_model, tmp_path, engines):
    (tmp_path / "in").mkdir()
    for s in range(3):
        pq.write_table(pa.Table.from_pylist(docs(5, 5 * s)), tmp_path / "in" / f"shard-{s}.parquet")
    seen = []
    summary = batchinfer.run(job(tiny_model, tmp_path, str(tmp_path / "in" / "shard-*.parquet")), engine_factory=engines, on_row=seen.append)
    df = read_out(tmp_path)
    assert sorted(df["doc_id"].to_list()) == list(range(15)) and len(seen) == 15
    assert df.schema["doc_id"] == pl.Int64 and df["title"].to_list() == [f"T{i}" for i in df["doc_id"].to_list()]
    assert set(df["finish_reason"].to_list()) <= {"stop", "length"} and df["error"].null_count() == 15
    assert (df["completion_tokens"] <= 4).all() and (df["prompt_tokens"] > 0).all()
    assert summary.this_run_rows == 15 and summary.error_rate == 0.0 and summary.rows_done == 15
    assert json.loads(layout.manifest_path(tmp_path / "out").read_text())["rows"] == 15
    again = run(job(tiny_model, tmp_path, str(tmp_path / "in")), engine_factory=engines)
    assert again.nothing_to_do and "nothing to do" in again.describe()
    # new shards arrive: only they are done
    pq.write_table(pa.Table.from_pylist(docs(3, 15)), tmp_path / "in" / "shard-3.parquet")
    more = run(job(tiny_model, tmp_path, str(tmp_path / "in")), engine_factory=engines)
    assert more.this_run_rows == 3 and sorted(read_out(tmp_path)["doc_id"].to_list()) == list(range(18))


def test_jsonl_bad_rows_and_rejects(tiny_model, tmp_path, engines):
    good = docs(6)
    lines = [json.dumps(r) for r in good[:3]]
    lines += ["this is not json", "[1, 2]", json.dumps({"text": "no id"})]
    lines += [json.dumps({"doc_id": 100, "title": "x"}), json.dumps({"doc_id": 101, "text": None}), json.dumps({"doc_id": 102, "text": {"a": 1}})]
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write("\n".join(json.dumps(r) for r in good[3:]) + "\n")
    s = run(job(tiny_model, tmp_path, str(tmp_path / "*.jsonl*")), engine_factory=engines)
    df = read_out(tmp_path).sort("doc_id")
    assert df["doc_id"].to_list() == [0, 1, 2, 3, 4, 5, 100, 101, 102]
    errs = dict(zip(df["doc_id"].to_list(), df["error"].to_list()))
    assert "template column 'text' is missing" in errs[100] and "a.jsonl line 7" in errs[100]
    assert "template column 'text' is null" in errs[101]
    assert "not a string or number" in errs[102]
    assert df.filter(pl.col("doc_id") >= 100)["finish_reason"].to_list() == ["error"] * 3
    rejects = [json.loads(x) for x in layout.rejects_path(tmp_path / "out").read_text().splitlines()]
    assert [(r["line"], r["text"][:8]) for r in rejects] == [(4, "this is "), (5, "[1, 2]"), (6, '{"text":')]
    assert all(r["file"].endswith("a.jsonl") and r["reason"] for r in rejects)
    assert s.rejects == 3 and s.error_rows == 3 and s.error_rate == pytest.approx(6 / 12)
    again = run(job(tiny_model, tmp_path, str(tmp_path / "*.jsonl*")), engine_factory=engines)
    assert again.nothing_to_do and again.rejects == 3


def test_prompt_longer_than_the_model_allows(tiny_model, tmp_path, engines):
    rows = docs(2) + [{"doc_id": 9, "text": "invoice " * 200, "title": "long"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    run(job(tiny_model, tmp_path, str(tmp_path / "in.parquet"), model={"max_model_len": 64}), engine_factory=engines)
    df = read_out(tmp_path).sort("doc_id")
    assert df["finish_reason"].to_list()[:2] != ["error", "error"]
    assert df["finish_reason"][2] == "error" and "tokens; the model allows at most 63" in df["error"][2]


def test_crash_then_resume_does_only_missing_rows(tiny_model, tmp_path, engines):
    pq.write_table(pa.Table.from_pylist(docs(20)), tmp_path / "in.parquet")
    j = job(tiny_model, tmp_path, str(tmp_path / "in.parquet"), output={"rows_per_part": 4})
    with pytest.raises(RuntimeError, match="device lost"):
        run(j, engine_factory=lambda spec, on_step=None: FailingEngine(engines(spec), 11))
    committed = read_out(tmp_path).height
    assert committed == 11  # the rows that finished before the crash are saved
    s = run(j, engine_factory=engines)
    assert s.this_run_rows == 20 - committed
    ids = read_out(tmp_path)["doc_id"]
    assert ids.n_unique() == ids.len() == 20


def test_changed_job_is_refused_unless_overwrite(tiny_model, tmp_path, engines):
    pq.write_table(pa.Table.from_pylist(docs(5)), tmp_path / "in.parquet")
    j = job(tiny_model, tmp_path, str(tmp_path / "in.parquet"))
    run(j, engine_factory=engines)
    changed = job(tiny_model, tmp_path, str(tmp_path / "in.parquet"), prompt={"template": "Other: {{ text }}"})
    with pytest.raises(JobError, match=r"different job \(changed: prompt\).*--overwrite"):
        run(changed, engine_factory=engines)
    s = run(changed, overwrite=True, engine_factory=engines)
    assert s.this_run_rows == 5 and read_out(tmp_path).height == 5
    # engine speed knobs do not change the fingerprint
    assert run(job(tiny_model, tmp_path, str(tmp_path / "in.parquet"), prompt={"template": "Other: {{ text }}"}, engine={"max_num_seqs": 4}), engine_factory=engines).nothing_to_do


class NeverRuns:
    """An engine stand-in for runs that must stop before any row reaches an engine."""

    def __init__(self, spec, on_step=None):
        self.started = True

    def generate(self, requests):
        raise AssertionError("no row may reach the engine")


def test_a_duplicate_id_found_while_the_engine_loads_stops_the_run_before_any_row(tiny_model, tmp_path):
    # a fresh output: the id scan runs on a thread while the engine loads; its error comes before any row
    pq.write_table(pa.Table.from_pylist(docs(3) + docs(1, 1)), tmp_path / "dup.parquet")
    with pytest.raises(InputError, match=r"duplicate id '1'.*dup.parquet line 2.*dup.parquet line 4"):
        run(job(tiny_model, tmp_path, str(tmp_path / "dup.parquet")), engine_factory=NeverRuns)
    assert not list((tmp_path / "out").glob("part-*.parquet"))


def test_a_resumed_job_checks_its_ids_before_loading_an_engine(tiny_model, tmp_path, engines):
    pq.write_table(pa.Table.from_pylist(docs(3)), tmp_path / "a.parquet")
    run(job(tiny_model, tmp_path, str(tmp_path / "*.parquet")), engine_factory=engines)
    pq.write_table(pa.Table.from_pylist(docs(1, 2)), tmp_path / "b.parquet")  # id 2 again

    def no_engine(spec, on_step=None):
        raise AssertionError("the engine must not start")

    with pytest.raises(InputError, match="duplicate id '2'"):
        run(job(tiny_model, tmp_path, str(tmp_path / "*.parquet")), engine_factory=no_engine)
    (tmp_path / "b.parquet").unlink()
    assert run(job(tiny_model, tmp_path, str(tmp_path / "*.parquet")), engine_factory=no_engine).nothing_to_do


def test_whole_job_problems_are_refused_before_the_engine(tiny_model, tmp_path):
    def no_engine(spec, on_step=None):
        raise AssertionError("the engine must not start")

    with pytest.raises(InputError, match="no id column 'doc_id'"):
        pq.write_table(pa.table({"x": [1]}), tmp_path / "noid.parquet")
        run(job(tiny_model, tmp_path, str(tmp_path / "noid.parquet")), engine_factory=no_engine)
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(InputError, match="broken.parquet"):
        run(job(tiny_model, tmp_path, str(tmp_path / "broken.parquet")), engine_factory=no_engine)
    pq.write_table(pa.Table.from_pylist(docs(2)), tmp_path / "ok.parquet")
    with pytest.raises(InputError, match="keep_columns: nope"):
        run(job(tiny_model, tmp_path, str(tmp_path / "ok.parquet"), output={"keep_columns": ["nope"]}), engine_factory=no_engine)
    from batchinfer.structured.base import GrammarError

    with pytest.raises(GrammarError):
        run(job(tiny_model, tmp_path, str(tmp_path / "ok.parquet"), structured={"regex": "(unclosed"}), engine_factory=no_engine)


def test_memory_stays_bounded_for_input_far_larger_than_the_queue(tiny_model, tmp_path, engines):
    pq.write_table(pa.Table.from_pylist(docs(120)), tmp_path / "big.parquet")
    stats = {"pulled": 0, "done": 0, "max_ahead": 0}

    class Counting:
        def __init__(self, engine):
            self.engine, self.tokenizer, self.model_info, self.max_model_len = engine, engine.tokenizer, engine.model_info, engine.max_model_len

        def generate(self, requests):
            def counted():
                for r in requests:
                    stats["pulled"] += 1
                    yield r

            for res in self.engine.generate(counted()):
                stats["done"] += 1
                stats["max_ahead"] = max(stats["max_ahead"], stats["pulled"] - stats["done"])
                yield res

    j = job(tiny_model, tmp_path, str(tmp_path / "big.parquet"), sampling={"max_tokens": 1}, input={"batch_size": 16}, output={"rows_per_part": 50})
    s = run(j, engine_factory=lambda spec, on_step=None: Counting(engines(spec)))
    assert s.this_run_rows == 120 and stats["done"] == 120
    # pulled but not yet yielded, bounded by the engine, not the input: its queue (2 x max_num_seqs),
    # the running sequences, the step in flight whose tokens are their last (final_pending: their
    # slots are free already), and the sequences finished in the iteration that planned the next
    # step ahead (engine.py: step N+2 is planned before N's results are returned) = 5 x max_num_seqs
    assert stats["max_ahead"] <= 5 * 8, stats


def test_json_schema_job_has_a_typed_output_column(tiny_model, tmp_path, engines):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    pq.write_table(pa.Table.from_pylist(docs(6)), tmp_path / "in.parquet")
    j = job(tiny_model, tmp_path, str(tmp_path / "in.parquet"), structured={"json_schema": str(tmp_path / "schema.json")}, sampling={"max_tokens": 24})
    run(j, engine_factory=engines)
    df = read_out(tmp_path)
    assert df.schema["output"] == pl.Struct({"ok": pl.Boolean})
    import jsonschema

    for text, reason, out, err in df.select("output_text", "finish_reason", "output", "error").iter_rows():
        if err is None:
            jsonschema.validate(json.loads(text), schema)
            assert out == json.loads(text)
        else:
            assert out is None and reason in ("length", "error")
    assert df["error"].null_count() >= 1


def test_choice_job(tiny_model, tmp_path, engines):
    pq.write_table(pa.Table.from_pylist(docs(4)), tmp_path / "in.parquet")
    run(job(tiny_model, tmp_path, str(tmp_path / "in.parquet"), structured={"choice": ["yes", "no"]}, sampling={"max_tokens": 4}), engine_factory=engines)
    df = read_out(tmp_path)
    assert "output" not in df.columns
    assert set(df.filter(pl.col("error").is_null())["output_text"].to_list()) <= {"yes", "no"}


def test_part_renamed_but_not_in_the_manifest_is_recovered_not_duplicated(tiny_model, tmp_path, engines, monkeypatch):
    from batchinfer.io import manifest as mf

    pq.write_table(pa.Table.from_pylist(docs(12)), tmp_path / "in.parquet")
    j = job(tiny_model, tmp_path, str(tmp_path / "in.parquet"), output={"rows_per_part": 4})
    real_add = mf.Manifest.add_part
    calls = {"n": 0}

    def crash_on_second(self, part):
        calls["n"] += 1
        if calls["n"] == 2:  # the part file is already renamed into place: "kill" before the manifest write
            raise KeyboardInterrupt("killed")
        real_add(self, part)

    monkeypatch.setattr(mf.Manifest, "add_part", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        run(j, engine_factory=engines)
    monkeypatch.setattr(mf.Manifest, "add_part", real_add)
    assert len(mf.part_files(tmp_path / "out")) == 2 and len(mf.Manifest.load(tmp_path / "out").parts) == 1
    s = run(j, engine_factory=engines)
    assert s.recovered_parts == 1 and s.this_run_rows == 4
    ids = read_out(tmp_path)["doc_id"]
    assert sorted(ids.to_list()) == list(range(12))


def test_two_runs_on_one_output_folder_are_refused(tiny_model, tmp_path, engines):
    from batchinfer.io.manifest import lock_output

    pq.write_table(pa.Table.from_pylist(docs(2)), tmp_path / "in.parquet")
    (tmp_path / "out").mkdir()
    held = lock_output(tmp_path / "out")
    with pytest.raises(JobError, match="another batchinfer run is writing"):
        run(job(tiny_model, tmp_path, str(tmp_path / "in.parquet")), engine_factory=engines)
    held.close()
    assert run(job(tiny_model, tmp_path, str(tmp_path / "in.parquet")), engine_factory=engines).this_run_rows == 2


def test_any_sequence_of_crashes_then_resume_is_exactly_once(tiny_model, engines):
    """Property: crash after any number of results, any part size, any number of times; then finish."""
    import tempfile

    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=6, deadline=None)
    @given(n=st.integers(3, 18), per_part=st.integers(1, 5), crashes=st.lists(st.integers(0, 12), max_size=3))
    def check(n, per_part, crashes):
        with tempfile.TemporaryDirectory() as d:
            tmp = Path(d)
            pq.write_table(pa.Table.from_pylist(docs(n)), tmp / "in.parquet")
            j = job(tiny_model, tmp, str(tmp / "in.parquet"), output={"rows_per_part": per_part})
            for after in crashes:
                try:
                    run(j, engine_factory=lambda spec, on_step=None: FailingEngine(engines(spec), after))
                except RuntimeError:
                    pass
                if list((tmp / "out").glob("*.parquet")):
                    ids = read_out(tmp)["doc_id"]
                    assert ids.n_unique() == ids.len()
            run(j, engine_factory=engines)
            assert sorted(read_out(tmp)["doc_id"].to_list()) == list(range(n))

    check()
