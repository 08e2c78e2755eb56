"""A real job across the GPUs of one host (engine.data_parallel), with engine workers SIGKILLed mid-run.

Model: the qwen3-0.6b shape (random weights, the real Qwen tokenizer); N documents of ~300 words;
JSON-schema answers. Two runs:
1. one worker killed after a quarter of the rows: the job goes on, the other worker(s) take its rows;
2. every worker killed after a third of the rows: the job fails; the resumed run finishes it.
Both must end with every id exactly once (and the manifest saying so).

Usage (device tool, 2+ GPUs): python3 scripts/gpu_multi_job.py [N] [WORKERS]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

import polars as pl

import batchinfer
from batchinfer.bench.shapes import write_shape
from batchinfer.io import layout
from batchinfer.job import RunError
from batchinfer.job.executors.data_parallel import sigkill_workers_after

WORDS = "invoice total amount due date customer order shipping payment account balance report".split()
SCHEMA = {
    "type": "object",
    "properties": {"kind": {"enum": ["invoice", "letter", "report"]}, "urgent": {"type": "boolean"},
                   "summary": {"type": "string", "maxLength": 80}},
    "required": ["kind", "urgent", "summary"],
    "additionalProperties": False,
}


def check_exactly_once(out: Path, n: int) -> None:
    ids = pl.read_parquet(out)["doc_id"].sort().to_list()  # the folder holds only the parts
    manifest = json.loads(layout.manifest_path(out).read_text())
    ok = ids == list(range(n)) and manifest["rows"] == n
    print(f"  {len(ids)} rows written, {len(set(ids))} distinct ids, manifest rows {manifest['rows']}: "
          f"{'every id exactly once' if ok else 'MISMATCH'}", flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 6000
    workers = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    tmp = Path(tempfile.mkdtemp())
    model = write_shape("qwen3-0.6b", tmp / "model")
    rng = random.Random(0)
    with open(tmp / "in.jsonl", "w") as f:
        for i in range(n):
            f.write(json.dumps({"doc_id": i, "text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(100, 500)))}) + "\n")
    (tmp / "schema.json").write_text(json.dumps(SCHEMA))

    def job(out: str) -> dict:
        return {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "input": {"path": str(tmp / "in.jsonl"), "id_column": "doc_id"},
            "output": {"path": str(tmp / out), "rows_per_part": 200},
            "prompt": {"template": "Classify this document.\n{{ text }}"},
            "sampling": {"max_tokens": 64, "temperature": 1.0, "seed": 0},
            "structured": {"json_schema": str(tmp / "schema.json")},
            "engine": {"data_parallel": workers, "load_format": "random"},
        }

    print(f"{n} documents, {workers} engine workers", flush=True)
    print("run 1: one worker killed after a quarter of the rows", flush=True)
    hook, killed = sigkill_workers_after(n // 4, 1)
    t0 = time.perf_counter()
    summary = batchinfer.run(job("out1"), on_progress=hook)
    print(f"  finished in {time.perf_counter() - t0:.1f} s: {summary.this_run_rows} rows this run, "
          f"{summary.rows_done} done, killed {len(killed)}", flush=True)
    check_exactly_once(tmp / "out1", n)

    print("run 2: every worker killed after a third of the rows, then resumed", flush=True)
    hook, killed = sigkill_workers_after(n // 3, workers)
    t0 = time.perf_counter()
    try:
        batchinfer.run(job("out2"), on_progress=hook)
        print("  the run did not fail: MISMATCH")
        sys.exit(1)
    except RunError as exc:
        parts = sorted((tmp / "out2").glob("*.parquet"))
        done = pl.read_parquet(parts)["doc_id"].to_list() if parts else []
        print(f"  failed as expected after {time.perf_counter() - t0:.1f} s ({exc}); {len(done)} rows committed, "
              f"{len(set(done))} distinct", flush=True)
    t0 = time.perf_counter()
    resumed = batchinfer.run(job("out2"))
    print(f"  resumed: {resumed.this_run_rows} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    check_exactly_once(tmp / "out2", n)


if __name__ == "__main__":
    main()
