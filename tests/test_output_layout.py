"""The output folder is exactly the output: every Parquet reader given the folder gets the output rows
and columns, after a failed run and after its resume; the run records sit beside it (io/layout.py);
an output folder written in the older layout (records inside it) migrates and resumes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.dataset as ds
import pytest

import batchinfer
from batchinfer.io import layout
from output_readers import READERS, assert_every_reader_sees

N = 23
COLUMNS = ["doc_id", "title", "output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error",
           "queue_wait_s", "ttft_s", "decode_s"]


def make_job(model: Path, tmp: Path, out: Path) -> dict:
    rows = [{"doc_id": f"d{i:03d}", "text": f"invoice {i} total {i * 3}", "title": f"T{i}"} for i in range(N)]
    (tmp / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": str(tmp / "docs.jsonl"), "id_column": "doc_id"},
        "output": {"path": str(out), "keep_columns": ["title"], "rows_per_part": 4},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 3},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 64},
    }


class Boom(RuntimeError):
    pass


def fail_after_commits(out: Path, parts: int):
    """An on_progress hook that raises once `parts` parts are committed (a run dying mid-way)."""

    def hook(progress) -> None:
        m = layout.manifest_path(out)
        if m.exists() and len(json.loads(m.read_text())["parts"]) >= parts:
            raise Boom("fault injected")

    return hook


def committed_ids(out: Path) -> list[str]:
    from batchinfer.io.manifest import Manifest

    m = Manifest.load(out)
    return m.finished_ids().to_list() if m else []


def test_every_reader_gets_exactly_the_output_before_and_after_a_failed_run(tiny_model, tmp_path, engines):
    out = tmp_path / "out" / "extract"
    job = make_job(tiny_model, tmp_path, out)
    with pytest.raises(Boom):
        batchinfer.run(job, engine_factory=engines, on_progress=fail_after_commits(out, 2))
    done = committed_ids(out)
    assert 8 <= len(done) < N
    assert sorted(p.name for p in out.iterdir()) == layout.part_names(out)  # nothing but parts, even after a failure
    assert_every_reader_sees(out, "doc_id", done, COLUMNS)

    s = batchinfer.run(job, engine_factory=engines)
    assert s.rows_done == N and s.this_run_rows == N - len(done) and s.rejects == 1
    assert_every_reader_sees(out, "doc_id", [f"d{i:03d}" for i in range(N)], COLUMNS)
    assert sorted(p.name for p in out.iterdir()) == layout.part_names(out)
    # the records are beside the output, named after it
    rec = tmp_path / "out" / "_extract.batchinfer"
    assert {p.name for p in rec.iterdir()} >= {"manifest.json", "rejects.jsonl", "rows", "report.json", "report.html"}
    assert json.loads((rec / "manifest.json").read_text())["rows"] == N
    assert json.loads((rec / "rejects.jsonl").read_text())["reason"].startswith("not valid JSON")
    assert s.report_path == str(rec / "report.html")
    # the parent folder read as a dataset (e.g. one output folder per day): pyarrow skips the `_` records folder
    assert ds.dataset(str(tmp_path / "out"), format="parquet").count_rows() == N


def test_an_output_folder_of_the_older_layout_migrates_and_resumes(tiny_model, tmp_path, engines):
    out = tmp_path / "old"
    job = make_job(tiny_model, tmp_path, out)
    with pytest.raises(Boom):
        batchinfer.run(job, engine_factory=engines, on_progress=fail_after_commits(out, 2))
    done = committed_ids(out)
    # put the records where older versions kept them: inside the output folder, under `_` names
    rec = layout.records_dir(out).local_path()
    for new, old in (("manifest.json", "_manifest.json"), ("rejects.jsonl", "_rejects.jsonl"), ("rows", "_rows"), ("steps", "_steps")):
        if (rec / new).exists():
            (rec / new).rename(out / old)
    (out / "_tmp.part-000099.parquet.tmp").write_bytes(b"half a part")
    (out / "_lock").write_text("")
    shutil.rmtree(rec)
    # read-only commands read the legacy manifest; report migrates (under the lock)
    from batchinfer.io.manifest import Manifest

    assert sorted(Manifest.load(out).finished_ids().to_list()) == sorted(done)
    text = batchinfer.observe.report_command(out)
    assert f"rows {len(done)}" in text and not (out / "_manifest.json").exists() and not (out / "_rows").exists()
    s = batchinfer.run(job, engine_factory=engines)
    assert s.this_run_rows == N - len(done) and s.rows_done == N
    assert sorted(p.name for p in out.iterdir()) == layout.part_names(out)
    assert_every_reader_sees(out, "doc_id", [f"d{i:03d}" for i in range(N)], COLUMNS)
    report = json.loads(layout.report_json_path(out).read_text())
    assert report["totals"]["rows"] == N and report["totals"]["runs"] == 2  # the first run's records moved with it


def test_a_run_that_never_migrates_still_resumes_from_a_legacy_manifest_alone(tiny_model, tmp_path, engines):
    """The oldest possible folder: parts and `_manifest.json` only (no records): resume skips its rows."""
    out = tmp_path / "old"
    job = make_job(tiny_model, tmp_path, out)
    with pytest.raises(Boom):
        batchinfer.run(job, engine_factory=engines, on_progress=fail_after_commits(out, 1))
    done = committed_ids(out)
    layout.manifest_path(out).local_path().rename(out / "_manifest.json")
    s = batchinfer.run(job, engine_factory=engines)
    assert s.this_run_rows == N - len(done)
    assert_every_reader_sees(out, "doc_id", [f"d{i:03d}" for i in range(N)], COLUMNS)


def test_output_path_at_a_root_is_refused(tiny_model, tmp_path):
    from batchinfer.job import JobError

    job = make_job(tiny_model, tmp_path, tmp_path)
    job["output"]["path"] = "/"
    with pytest.raises(JobError, match="below a root or bucket"):
        batchinfer.run(job)


@pytest.mark.slow
def test_spark_reads_the_folder(tiny_model, tmp_path, engines):
    pyspark = pytest.importorskip("pyspark")
    out = tmp_path / "out"
    batchinfer.run(make_job(tiny_model, tmp_path, out), engine_factory=engines)
    spark = pyspark.sql.SparkSession.builder.master("local[1]").appName("batchinfer-test").getOrCreate()
    try:
        df = spark.read.parquet(str(out))
        assert df.columns == COLUMNS
        assert sorted(r.doc_id for r in df.select("doc_id").collect()) == [f"d{i:03d}" for i in range(N)]
    finally:
        spark.stop()


def test_readers_list_is_what_the_issue_names():
    assert set(READERS) == {"pyarrow.dataset", "polars.read_parquet", "polars.scan_parquet", "duckdb.read_parquet", "pandas.read_parquet"}
