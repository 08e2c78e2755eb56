"""SIGTERM / SIGINT / --stop-after stop a run gracefully (finished rows committed, manifest and a
partial report written, exit 75); a second signal exits at once without a traceback; the next run
resumes with every id exactly once. Real `python3 -m batchinfer.cli run` subprocesses, signalled
after the first commit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from batchinfer.io import layout

EXIT_STOPPED = 75


def committed(out: Path) -> int:
    try:
        return len(json.loads(layout.manifest_path(out).read_text())["parts"])
    except (OSError, ValueError, KeyError):
        return 0


def make_job(tmp: Path, model: Path, n_rows: int, **engine) -> Path:
    (tmp / "in.jsonl").write_text("".join(json.dumps({"doc_id": f"d{i:03d}", "text": f"invoice {i} total {i * 3}"}) + "\n"
                                          for i in range(n_rows)))
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": "in.jsonl", "id_column": "doc_id"},
        "output": {"path": "out", "rows_per_part": 2, "seconds_per_part": 0.2},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 4},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 64, **engine},
    }))
    return job


def start(job: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "run", str(job), *args], env=env, cwd=job.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_commit(p: subprocess.Popen, out: Path, parts: int = 1, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while committed(out) < parts and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.poll() is None, f"the run ended before the signal:\n{p.communicate()[0]}"
    assert committed(out) >= parts


def finish_and_check(job: Path, n_rows: int) -> None:
    """Resume (in this process: the same code as the CLI's run), then every id exactly once."""
    from batchinfer.job import run_job as run

    s = run(job, report=False)
    assert s.stopped is None and s.rows_done == n_rows
    ids = pl.read_parquet(job.parent / "out" / "*.parquet")["doc_id"].to_list()
    assert sorted(ids) == [f"d{i:03d}" for i in range(n_rows)]  # every id exactly once


def test_sigterm_after_a_commit_stops_gracefully_and_resumes(tiny_model, tmp_path):
    n = 96  # enough rows that a loaded host does not finish them between the first commit and the signal
    job = make_job(tmp_path, tiny_model, n)
    out = tmp_path / "out"
    p = start(job)
    wait_for_commit(p, out)
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=120)[0]
    assert p.returncode == EXIT_STOPPED, text
    assert "Traceback" not in text
    assert "stopped (SIGTERM received)" in text and "run the same command again to resume" in text
    manifest = json.loads(layout.manifest_path(out).read_text())
    assert manifest["parts"] and manifest["rows"] < n
    report = json.loads(layout.report_json_path(out).read_text())
    assert report["run"]["summary"]["stopped"] == "SIGTERM received"  # the partial report
    assert [p.name for p in out.iterdir() if not p.name.startswith("part-")] == [] and not layout.tmp_dir(out).files()
    finish_and_check(job, n)


def test_second_signal_exits_at_once_without_a_traceback(tiny_model, tmp_path):
    n = 24
    job = make_job(tmp_path, tiny_model, n)
    out = tmp_path / "out"
    p = start(job)
    wait_for_commit(p, out)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGINT)
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=120)[0]
    assert p.returncode == EXIT_STOPPED, text
    assert "Traceback" not in text and "Exception ignored" not in text, text
    finish_and_check(job, n)


def test_stop_after_deadline(tiny_model, tmp_path):
    """--stop-after: a bad duration is the user's error (exit 2); a deadline stops the run with 75."""
    from typer.testing import CliRunner

    from batchinfer.cli import app
    from batchinfer.job.stop import parse_duration

    job = make_job(tmp_path, tiny_model, 8)
    bad = CliRunner().invoke(app, ["run", str(job), "--stop-after", "soon"])
    assert bad.exit_code == 2 and "--stop-after 'soon'" in bad.output and bad.exception is None or isinstance(bad.exception, SystemExit)

    assert [parse_duration(x) for x in ("90m", "2h", "3600s", "1h30m", "45", "250ms")] == [5400, 7200, 3600, 5400, 45, 0.25]
    p = start(job, "--stop-after", "1ms")
    text = p.communicate(timeout=120)[0]
    assert p.returncode == EXIT_STOPPED and "deadline" in text and "Traceback" not in text, text
    finish_and_check(job, 8)


@pytest.mark.slow
def test_sigterm_with_data_parallel_workers(tiny_model, tmp_path):
    """Two CPU engine workers: SIGTERM to the driver, the workers commit what finished, exit 75; resume."""
    n = 320  # enough rows that the workers cannot finish them all between the first commit and the signal
    job = make_job(tmp_path, tiny_model, n, data_parallel=2)
    out = tmp_path / "out"
    p = start(job)
    wait_for_commit(p, out, timeout=300)
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=180)[0]
    assert p.returncode == EXIT_STOPPED, text
    assert "Traceback" not in text
    assert json.loads(layout.manifest_path(out).read_text())["rows"] < n
    finish_and_check(job, n)
