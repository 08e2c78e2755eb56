"""Observability wired into the job driver and CLI, end to end on a tiny random model (CPU):
the report's totals equal the output's, a live scrape of --metrics-port sees the counters move, the
token-id sidecar decodes back to the rendered prompts, the trace and textfile are written, and
`batchinfer report OUT_DIR` prints the summary again and rewrites the page.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import batchinfer
from batchinfer.cli import app
from batchinfer.io import layout
from batchinfer.io.manifest import Manifest
from batchinfer.job.spec import JobError, load_job
from batchinfer.observe import read_token_ids
from batchinfer.job import make_engine
from failing_engine import FailingEngine

N_ROWS = 36
runner = CliRunner()


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def samples(text: str) -> dict[str, float]:
    """name{labels} -> value of a Prometheus text page (label-free names as they are)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def rows_total(values: dict[str, float]) -> float:
    return sum(v for k, v in values.items() if k.startswith("batchinfer_rows_total"))


class Scraper(threading.Thread):
    """Scrapes http://127.0.0.1:PORT/metrics every 20 ms until stopped (a real HTTP client)."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.stop, self.seen = port, threading.Event(), []

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as resp:
                    self.seen.append(samples(resp.read().decode()))
            except OSError:
                pass  # not serving yet, or already stopped
            time.sleep(0.02)


def write_job(tmp: Path, model: Path, n: int = N_ROWS, **engine) -> Path:
    rows = [{"doc_id": f"d{i:03d}", "text": f"invoice {i} total {i * 7} café"} for i in range(n)]
    lines = [json.dumps(r) for r in rows]
    lines.insert(5, json.dumps({"doc_id": "bad", "body": "no text column"}))  # fails before the engine
    lines.insert(9, "not json at all")  # a reject: no id
    (tmp / "docs.jsonl").write_text("\n".join(lines) + "\n")
    job = {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": "docs.jsonl", "id_column": "doc_id"},
        "output": {"path": "out", "rows_per_part": 8},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 6, "ignore_eos": True},
        "engine": {"max_num_seqs": 2, "device": "cpu", "num_kv_blocks": 64, **engine},
    }
    p = tmp / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    return p


def check_report_matches_output(out: Path) -> dict:
    """The report's totals are the output's: rows, errors, finish reasons, token sums."""
    table = pq.read_table(sorted(str(p) for p in out.glob("part-*.parquet"))).to_pylist()
    report = json.loads(layout.report_json_path(out).read_text())
    t = report["totals"]
    assert t["rows"] == len(table)
    assert t["errors"] == sum(r["error"] is not None for r in table)
    assert t["prompt_tokens"] == sum(r["prompt_tokens"] for r in table)
    assert t["completion_tokens"] == sum(r["completion_tokens"] for r in table)
    reasons: dict[str, int] = {}
    for r in table:
        reasons[r["finish_reason"]] = reasons.get(r["finish_reason"], 0) + 1
    assert t["finish_reasons"] == reasons
    assert report["output"]["matches_records"] and report["output"]["rows_without_record"] == 0
    assert report["fingerprint"] == json.loads(layout.manifest_path(out).read_text())["fingerprint"]
    return report


def test_cli_run_with_every_option_then_report(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = write_job(tmp_path, tiny_model)
    out = tmp_path / "out"
    port = free_port()
    scraper = Scraper(port)
    scraper.start()
    try:
        r = invoke("run", job, "-q", "--max-error-rate", "0.5", "--metrics-port", port,
                   "--metrics-textfile", tmp_path / "batchinfer.prom",
                   "--log-token-ids", "--trace", tmp_path / "trace")
    finally:
        scraper.stop.set()
        scraper.join(timeout=10)
    assert r.exit_code == 0, r.output
    assert f"report: {layout.report_html_path(out)}" in r.output

    # the live scrape saw the counters move during the run, never backwards
    counts = [rows_total(s) for s in scraper.seen]
    steps = [s.get("batchinfer_steps_total", 0.0) for s in scraper.seen]
    assert counts == sorted(counts) and steps == sorted(steps)
    assert any(0 < c < N_ROWS + 1 for c in counts), counts  # a scrape mid-run
    assert len(set(counts)) >= 3 and len(set(steps)) >= 3, (counts, steps)

    # output: one row per id (the bad row as an error), per-row timings for the engine's rows
    table = pq.read_table(sorted(str(p) for p in out.glob("part-*.parquet"))).to_pylist()
    assert sorted(r["doc_id"] for r in table) == sorted([f"d{i:03d}" for i in range(N_ROWS)] + ["bad"])
    for row in table:
        timings = [row["queue_wait_s"], row["ttft_s"], row["decode_s"]]
        if row["doc_id"] == "bad":
            assert row["finish_reason"] == "error" and timings == [None, None, None]
        else:
            assert row["completion_tokens"] == 6 and all(x is not None and x >= 0 for x in timings)

    report = check_report_matches_output(out)
    assert report["errors_by_kind"] and sum(e["count"] for e in report["errors_by_kind"].values()) == 1
    assert report["output"]["rejects"] == 1
    assert report["config"]["engine"]["max_num_seqs"] == 2 and "torch" in report["versions"]
    assert report["kv"]["total_blocks"] == 64 and report["totals"]["steps"] > N_ROWS // 2
    assert report["latency_s"]["ttft"]["count"] == N_ROWS

    # the textfile holds the final counters
    final = samples((tmp_path / "batchinfer.prom").read_text())
    assert rows_total(final) == N_ROWS + 1
    assert final["batchinfer_tokens_total{kind=completion}"] == 6 * N_ROWS
    assert final["batchinfer_steps_total"] == report["totals"]["steps"]

    # the token-id sidecar decodes back to the prompts as batchinfer.job.prompts renders them
    from batchinfer.models.loader import load_tokenizer
    from batchinfer.job.prompts import PromptBuilder

    spec = load_job(job)
    tok = load_tokenizer(tiny_model)
    builder = PromptBuilder(spec.prompt, tok)
    ids = {row["id"]: row for row in read_token_ids(out).iter_rows(named=True)}
    assert sorted(ids) == sorted(f"d{i:03d}" for i in range(N_ROWS))  # the bad row never had ids
    outputs = {r["doc_id"]: r for r in table}
    for i in range(N_ROWS):
        text, want = builder.encode({"text": f"invoice {i} total {i * 7} café"})
        got = ids[f"d{i:03d}"]
        assert got["prompt_token_ids"] == want
        assert tok.decode(got["prompt_token_ids"], skip_special_tokens=False) == text
        assert tok.decode(got["output_token_ids"], skip_special_tokens=True) == outputs[f"d{i:03d}"]["output_text"]

    # a profiler trace of a few steps
    traces = list((tmp_path / "trace").glob("trace-steps-*.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]

    # `batchinfer report` prints the summary again and rewrites the page
    layout.report_html_path(out).delete()
    again = invoke("report", out)
    assert again.exit_code == 0, again.output
    assert f"rows {N_ROWS + 1:,} (ok {N_ROWS:,}, error 1)" in again.output
    assert layout.report_html_path(out).exists() and "<img" in layout.report_html_path(out).read_text()
    rewritten = json.loads(layout.report_json_path(out).read_text())
    assert rewritten["totals"] == report["totals"] and rewritten["config"] == report["config"]

    # the page renders in a real browser (headless Chromium), when one is installed
    from test_observe_page import CHROMIUM, PROBE

    if CHROMIUM is not None:
        probed = tmp_path / "probed.html"
        probed.write_text(layout.report_html_path(out).read_text().replace("</body>", PROBE))
        cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
               f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000", "--dump-dom", probed.as_uri()]
        dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
        assert 'data-probed="yes"' in dom
        sizes = re.findall(r'data-decoded="(\d+)x(\d+)"', dom)
        assert len(sizes) == len(re.findall(r"<img\b", dom)) >= 3 and all(int(w) > 0 for w, _ in sizes)


def test_report_command_errors(tmp_path):
    r = invoke("report", tmp_path / "missing")
    assert r.exit_code == 2 and "no such output folder" in r.output and "Traceback" not in r.output
    (tmp_path / "empty").mkdir()
    r = invoke("report", tmp_path / "empty")
    assert r.exit_code == 2 and "no run records" in r.output


def test_bad_options_are_refused_before_the_engine(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = write_job(tmp_path, tiny_model, n=3)
    r = invoke("run", job, "--log-level", "loud")
    assert r.exit_code == 2 and "--log-level must be one of debug, info, warning, error" in r.output
    r = invoke("run", job, "--metrics-textfile", tmp_path / "nodir" / "m.prom")
    assert r.exit_code == 2 and "--metrics-textfile" in r.output and "does not exist" in r.output
    assert invoke("run", job, "--metrics-port", "70000").exit_code == 2

    def no_engine(spec, on_step=None):
        raise AssertionError("the engine must not start")

    with socket.socket() as held:  # a port another process listens on
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(JobError, match="--metrics-port .*cannot listen"):
            batchinfer.run(job, metrics_port=held.getsockname()[1], engine_factory=no_engine)
    assert not list((tmp_path / "out").glob("part-*.parquet"))


def test_crash_then_resume_report_covers_both_runs(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = write_job(tmp_path, tiny_model, n=14)
    out = tmp_path / "out"
    port = free_port()
    with pytest.raises(RuntimeError, match="device lost"):
        batchinfer.run(job, metrics_port=port, engine_factory=lambda spec, on_step=None: FailingEngine(make_engine(spec, on_step), 9))
    assert not layout.report_json_path(out).exists()  # a failed run writes no report ...
    with socket.socket() as s:  # ... and frees its metrics port
        s.bind(("127.0.0.1", port))
    committed = sum(p.rows for p in Manifest.load(out).parts)
    assert 0 < committed < 15
    first_ids = set(pq.read_table(sorted(str(p) for p in out.glob("part-*.parquet"))).column("doc_id").to_pylist())
    s = batchinfer.run(job, log_token_ids=True)
    assert s.this_run_rows == 15 - committed and s.report_path == str(layout.report_html_path(out))
    report = check_report_matches_output(out)
    assert report["totals"]["rows"] == 15 and report["totals"]["runs"] == 2
    assert report["run"]["summary"]["this_run_rows"] == 15 - committed
    engine_rows = {f"d{i:03d}" for i in range(14)} - first_ids
    assert set(read_token_ids(out)["id"].to_list()) == engine_rows  # this run's rows that reached the engine


def test_resume_of_output_written_before_the_timing_columns_keeps_its_schema(tiny_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = write_job(tmp_path, tiny_model, n=10)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="device lost"):
        batchinfer.run(job, engine_factory=lambda spec, on_step=None: FailingEngine(make_engine(spec, on_step), 4))
    old = ["queue_wait_s", "ttft_s", "decode_s"]
    for part in out.glob("part-*.parquet"):  # as an older batchinfer wrote them
        t = pq.read_table(part)
        pq.write_table(t.drop_columns(old), part)
    batchinfer.run(job)
    schemas = {tuple(pq.read_schema(p).names) for p in out.glob("part-*.parquet")}
    assert len(schemas) == 1 and not set(old) & set(next(iter(schemas)))
    assert sorted(pq.read_table(sorted(str(p) for p in out.glob("part-*.parquet"))).column("doc_id").to_pylist()) == sorted(
        [f"d{i:03d}" for i in range(10)] + ["bad"])
