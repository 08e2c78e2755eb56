"""kill -9 at several moments, then resume: every input id exactly once (subprocess CLI runs), and
every reader of the output folder (pyarrow, polars, DuckDB, pandas) reads exactly the committed rows
after each kill and after the resume."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import yaml

from batchinfer.io import layout
from output_readers import assert_every_reader_sees

N_ROWS = 90
COLUMNS = ["doc_id", "output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error",
           "queue_wait_s", "ttft_s", "decode_s"]


def committed_parts(out: Path) -> int:
    try:
        return len(json.loads(layout.manifest_path(out).read_text())["parts"])
    except (OSError, ValueError, KeyError):
        return 0


def part_ids(out: Path) -> list[str]:
    files = sorted(out.glob("part-*.parquet"))
    return [i for f in files for i in pq.read_table(f, columns=["doc_id"]).column("doc_id").to_pylist()]


def start(job: Path) -> subprocess.Popen:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "run", str(job), "-q"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_sigkill_at_several_points_then_resume_exactly_once(tiny_model, tmp_path):
    rows = [{"doc_id": f"d{i:03d}", "text": f"invoice {i} total {i * 7} date {i % 13}"} for i in range(N_ROWS)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:50]))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in rows[50:]))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "input": {"path": "*.jsonl*", "id_column": "doc_id"},
        "output": {"path": "out", "rows_per_part": 3, "seconds_per_part": 0.3},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 4},
        "engine": {"max_num_seqs": 2, "device": "cpu", "num_kv_blocks": 64},
    }))
    out = tmp_path / "out"
    # (new committed parts to wait for, then a delay): during start-up, right after a commit, and at
    # an odd moment between commits (progress-based, so it does not depend on the machine's speed)
    for min_parts, delay in ((0, 1.0), (1, 0.0), (3, 0.013)):
        before = committed_parts(out)
        p = start(job)
        deadline = time.monotonic() + 120
        while committed_parts(out) < before + min_parts and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(delay)
        assert p.poll() is None, f"the run ended before the kill:\n{p.communicate()[0]}"
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        ids = part_ids(out)
        assert len(ids) == len(set(ids)), "a committed part duplicated a row"
        if ids:  # the folder holds whole parts only, whatever the kill interrupted
            assert_every_reader_sees(out, "doc_id", ids, COLUMNS)
    assert 4 <= committed_parts(out) < N_ROWS // 3 - 5, "the kills did not land mid-run"
    done = subprocess.run([sys.executable, "-m", "batchinfer.cli", "run", str(job), "-q"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])  # stdout is a pipe: the summary as a JSON line
    assert summary["status"] == "done" and summary["rows_done"] == N_ROWS and summary["exit_code"] == 0
    assert "done:" in done.stderr  # the human summary
    df = pl.read_parquet(out / "*.parquet")
    assert sorted(df["doc_id"].to_list()) == [r["doc_id"] for r in rows]  # every id exactly once
    assert_every_reader_sees(out, "doc_id", [r["doc_id"] for r in rows], COLUMNS)
    assert json.loads(layout.manifest_path(out).read_text())["rows"] == N_ROWS
    assert [f.name for f in out.iterdir() if not f.name.startswith("part-")] == []
    assert not layout.tmp_dir(out).files()
    from batchinfer.job import run_job as run

    assert run(job).nothing_to_do
