"""Progress for people who are not at a terminal: log lines on a pipe, JSON lines for log collectors,
and on a terminal a bar that moves per row and shows output tok/s."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import time

import yaml

from batchinfer.job.progress import ProgressDisplay, ProgressOptions, progress_fields, progress_text
from batchinfer.job.summary import Progress, RowRecord
from batchinfer.observe.logs import FIELDS, JsonFormatter

PROGRESS_KEYS = {"rows_done", "rows_total", "rows_per_s", "output_tokens_per_s", "eta_s", "errors", "elapsed_s"}


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_cli_writes_json_progress_and_phase_lines_to_a_pipe(tiny_model, tmp_path):
    rows = [{"doc_id": f"d{i}", "text": f"invoice {i} total {i * 3}"} for i in range(12)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "input": {"path": "docs.jsonl", "id_column": "doc_id"},
        "output": {"path": "out", "rows_per_part": 5},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 4},
        "engine": {"max_num_seqs": 2, "device": "cpu", "num_kv_blocks": 64},
    }))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "batchinfer.cli", "run", str(job), "--progress-interval", "0.2", "--log-format", "json",
         "--max-error-rate", "1"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    summary = json.loads(p.stdout.splitlines()[-1])  # a pipe: the summary is one JSON line, the last on stdout
    assert summary["status"] == "done" and summary["exit_code"] == 0
    lines = [json.loads(line) for line in p.stderr.splitlines() if line.strip()]  # every stderr line is JSON
    assert any(o.get("event") == "summary" and "done: 12 rows" in o["message"] for o in lines)
    assert all({"time", "level", "logger", "message"} <= set(o) for o in lines)
    progress = [o for o in lines if o.get("event") == "progress"]
    assert progress, "no progress line on a pipe"
    assert all(PROGRESS_KEYS <= set(o) and o["rows_total"] == 12 for o in progress)
    assert progress[-1]["rows_done"] == 12 and progress[-1]["errors"] == 1  # the last line has the final count
    assert [o["rows_done"] for o in progress] == sorted(o["rows_done"] for o in progress)
    phases = [o for o in lines if o.get("event") == "phases"]
    assert len(phases) == 1
    names = {s["name"] for s in phases[0]["spans"]}
    assert {"input_scan", "tokenizer", "engine_start", "engine.model_load", "report"} <= names
    marks = phases[0]["marks"]
    assert marks["imports_done"] <= marks["engine_ready"] <= marks["first_step"] <= marks["last_row_done"] <= marks["exit"]


def test_text_progress_lines_every_interval_when_stderr_is_not_a_terminal(caplog):
    stats = Progress()
    caplog.set_level(logging.INFO, logger="batchinfer.progress")
    display = ProgressDisplay(10, stats, ProgressOptions(show=True, interval_s=0.05), stream=io.StringIO())
    assert display.mode == "log"
    for _ in range(4):
        stats.add(RowRecord("x", "stop", 5, 7))
        display.update()
    time.sleep(0.3)
    display.close()
    lines = [r for r in caplog.records if r.name == "batchinfer.progress"]
    assert len(lines) >= 3  # a few intervals, and the last line at close
    last = lines[-1]
    assert last.getMessage().startswith("progress: 4/10 rows (40.0%)")
    assert "output tok/s" in last.getMessage() and "ETA" in last.getMessage()
    assert getattr(last, FIELDS)["rows_done"] == 4


def test_no_lines_and_no_bar_when_progress_is_off(caplog):
    caplog.set_level(logging.INFO, logger="batchinfer.progress")
    display = ProgressDisplay(3, Progress(), ProgressOptions(show=False, interval_s=0.01), stream=Tty())
    display.update()
    time.sleep(0.05)
    display.close()
    assert display.mode == "off" and not [r for r in caplog.records if r.name == "batchinfer.progress"]


def test_on_a_terminal_the_bar_moves_per_row_and_shows_output_tokens_per_second():
    stream = Tty()
    stats = Progress()
    display = ProgressDisplay(5, stats, ProgressOptions(show=True), stream=stream)
    assert display.mode == "bar"
    for k in range(3):
        stats.add(RowRecord("x", "stop", 1, 10))
        display.update()
        assert display._bar.n == k + 1  # one step per finished row
    display.close()
    assert "out tok/s" in stream.getvalue() and "3/5" in stream.getvalue()


def test_progress_numbers_and_text():
    stats = Progress(rows=50, errors=2, completion_tokens=1000, rejects=1, started=100.0)
    f = progress_fields(stats, 200, now=110.0)
    assert f["rows_per_s"] == 5.0 and f["output_tokens_per_s"] == 100.0 and f["eta_s"] == 30.0 and f["errors"] == 3
    assert progress_text(f) == "progress: 50/200 rows (25.0%), 5.0 rows/s, 100 output tok/s, ETA 30s, 3 errors"
    assert progress_fields(Progress(started=0.0), 10, now=1.0)["eta_s"] is None


def test_json_log_lines_parse_and_carry_their_fields():
    record = logging.LogRecord("batchinfer.x", logging.WARNING, __file__, 1, "hello %s", ("world",), None)
    setattr(record, FIELDS, {"event": "progress", "rows_done": 3, "message": "not overwritten"})
    obj = json.loads(JsonFormatter().format(record))
    assert obj["message"] == "hello world" and obj["level"] == "warning" and obj["rows_done"] == 3
    assert obj["time"].endswith("Z") and obj["logger"] == "batchinfer.x"
