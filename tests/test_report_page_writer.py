"""`batchinfer run` writes report.json before it exits and leaves report.html to a detached process
(observe/page_writer.py); that page is the one the run would have drawn itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_signals import make_job

from batchinfer.io import layout
from batchinfer.observe.observer import ObserveOptions
from batchinfer.observe.page_writer import main as page_writer_main


def run_cli(job: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "batchinfer.cli", "run", str(job), "--quiet", *args], env=env,
                          cwd=job.parent, capture_output=True, text=True, timeout=300)


def wait_for(path: Path, timeout: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return path.exists()


def test_the_command_exits_before_the_page_which_follows_and_is_the_runs_own(tiny_model, tmp_path):
    job = make_job(tmp_path, tiny_model, 6)
    out = tmp_path / "out"
    done = run_cli(job)
    assert done.returncode == 0, done.stderr
    assert json.loads(layout.report_json_path(out).read_text())["totals"]["rows"] == 6  # written before the exit
    page = Path(str(layout.report_html_path(out)))
    assert wait_for(page), "the detached process drew no page"
    drawn = page.read_text()
    assert "<img" in drawn and "could not be drawn" not in drawn
    # the page the run would have drawn itself: the same, from the same report.json and records
    page.unlink()
    assert page_writer_main([str(out)]) == 0
    assert page.read_text() == drawn


def test_wait_for_report_draws_the_page_before_the_exit(tiny_model, tmp_path):
    job = make_job(tmp_path, tiny_model, 6)
    done = run_cli(job, "--wait-for-report")
    assert done.returncode == 0, done.stderr
    assert Path(str(layout.report_html_path(tmp_path / "out"))).exists()


def test_page_writer_failure_leaves_a_page_that_says_what_to_do(tmp_path, capsys):
    out = tmp_path / "out"
    layout.records_dir(layout.output_dir(out)).makedirs()
    layout.report_json_path(layout.output_dir(out)).write_text("{not json")
    assert page_writer_main([str(out)]) == 1
    text = Path(str(layout.report_html_path(layout.output_dir(out)))).read_text()
    assert "could not be drawn" in text and f"batchinfer report {out}" in text
    assert "page_writer: " in capsys.readouterr().err
    assert page_writer_main([]) == 2


def test_page_mode_is_checked():
    with pytest.raises(ValueError, match="page must be one of inline, detached"):
        ObserveOptions(out_dir="x", page="later")
