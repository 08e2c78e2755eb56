"""--executor ray on a local Ray instance gives the same output as the local executor (greedy float32)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

import batchinfer  # noqa: E402
from batchinfer.io.manifest import MANIFEST  # noqa: E402

N_ROWS = 24


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


def write_inputs(tmp: Path) -> None:
    """Half the rows in a Parquet shard, half in JSONL: both Ray readers are used."""
    rows = [{"doc_id": i, "text": f"invoice {i} total {i * 7} date {i % 13}", "title": f"T{i}"} for i in range(N_ROWS)]
    (tmp / "in").mkdir()
    pq.write_table(pa.Table.from_pylist(rows[: N_ROWS // 2]), tmp / "in" / "a.parquet")
    (tmp / "in" / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[N_ROWS // 2:]))


def job(model: Path, tmp: Path, out: str, **output) -> dict:
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": str(tmp / "in"), "id_column": "doc_id"},
        "output": {"path": str(tmp / out), "keep_columns": ["title"], "rows_per_part": 5, **output},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 6},
        "engine": {"max_num_seqs": 8, "device": "cpu", "num_kv_blocks": 96, "data_parallel": 1},
    }


def test_ray_executor_matches_local_and_resumes(tiny_model, tmp_path, local_ray):
    write_inputs(tmp_path)
    local = batchinfer.run(job(tiny_model, tmp_path, "local"))
    # resume through the same manifest: a first local run did some rows, Ray does the rest
    first = job(tiny_model, tmp_path, "ray")
    first["input"]["path"] = str(tmp_path / "in" / "a.parquet")
    batchinfer.run(first)
    seen = []
    summary = batchinfer.run(job(tiny_model, tmp_path, "ray"), executor="ray", on_row=seen.append)
    assert summary.this_run_rows == N_ROWS // 2 and len(seen) == N_ROWS // 2 and summary.rows_done == N_ROWS
    a = pl.read_parquet(tmp_path / "local" / "*.parquet").sort("doc_id")
    b = pl.read_parquet(tmp_path / "ray" / "*.parquet").sort("doc_id")
    assert b["doc_id"].to_list() == list(range(N_ROWS))  # every id exactly once
    assert b.columns == a.columns and b.schema == a.schema
    cols = ["doc_id", "title", "output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error"]
    assert a.select(cols).equals(b.select(cols))  # identical output_text per id
    assert json.loads((tmp_path / "ray" / MANIFEST).read_text())["rows"] == N_ROWS
    assert local.this_run_rows == N_ROWS
    assert batchinfer.run(job(tiny_model, tmp_path, "ray"), executor="ray").nothing_to_do

