"""Run a batch job from Python and read the answers back.

    batchinfer demo-model .demo/model     # once: a small random model (gibberish answers)
    python examples/python_api.py
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

import batchinfer

HERE = Path(__file__).resolve().parent

job = {
    "model": {"path": str(HERE.parent / ".demo" / "model"), "dtype": "float32"},
    "input": {"path": str(HERE / "data" / "docs.jsonl"), "id_column": "doc_id"},
    "output": {"path": str(HERE.parent / "out" / "python-api"), "keep_columns": ["title"]},
    "prompt": {"template": "Document:\n{{ text }}\nIs it urgent? Answer yes or no."},
    "sampling": {"max_tokens": 4},
    "structured": {"choice": ["yes", "no"]},
    "engine": {"max_num_seqs": 16},
}

if __name__ == "__main__":
    summary = batchinfer.run(job)  # also accepts a YAML path or a JobSpec
    print(summary.describe())
    if summary.error_rate > 0.05:
        raise SystemExit(f"too many errors: {summary.error_rate:.1%}")
    # the output folder holds only the part files: any Parquet reader takes it as it is
    answers = pl.read_parquet(summary.output_path)
    print(answers.select("doc_id", "title", "output_text", "finish_reason").head())
