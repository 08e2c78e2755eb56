"""Prometheus metrics of a run: served live on a port, and/or written as a node-exporter textfile.

Every Metrics object has its own CollectorRegistry (never the process-wide default one), so two runs
in one process, or the tests, never see each other's counters.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

from batchinfer.engine.stats import StepStats
from batchinfer.observe.records import RowOutcome, row_metrics

log = logging.getLogger(__name__)

PREFIX = "batchinfer"
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class Metrics:
    """The run's counters, gauges and histograms; fed by on_step / on_row."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.rows = Counter(f"{PREFIX}_rows", "Rows finished, by finish reason.", ["finish_reason"], registry=r)
        self.tokens = Counter(f"{PREFIX}_tokens", "Tokens of finished rows, by kind.", ["kind"], registry=r)
        self.preemptions = Counter(f"{PREFIX}_preemptions", "Sequences preempted by the scheduler.", registry=r)
        self.steps = Counter(f"{PREFIX}_steps", "Engine steps run.", registry=r)
        self.step_tokens = Counter(
            f"{PREFIX}_step_tokens", "Tokens processed by engine steps, by phase.", ["phase"], registry=r
        )
        self.running = Gauge(f"{PREFIX}_running", "Sequences running after the last step.", registry=r)
        self.waiting = Gauge(f"{PREFIX}_waiting", "Sequences waiting after the last step.", registry=r)
        self.kv_used = Gauge(f"{PREFIX}_kv_blocks_used", "KV cache blocks in use.", registry=r)
        self.kv_free = Gauge(f"{PREFIX}_kv_blocks_free", "KV cache blocks free.", registry=r)
        self.step_time = Histogram(
            f"{PREFIX}_step_seconds", "Wall time of one engine step.", buckets=STEP_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_ttft_seconds", "Arrival to first output token, per row.", buckets=LATENCY_BUCKETS, registry=r
        )
        self.latency = Histogram(
            f"{PREFIX}_row_latency_seconds", "Arrival to finish, per row.", buckets=LATENCY_BUCKETS, registry=r
        )
        for kind in ("prompt", "completion"):  # export zeros from the start: rate() needs a first sample
            self.tokens.labels(kind=kind)
        for phase in ("prefill", "decode"):
            self.step_tokens.labels(phase=phase)
        self._server: Any = None
        self._thread: Any = None

    def on_step(self, stats: StepStats) -> None:
        self.steps.inc()
        self.step_tokens.labels(phase="prefill").inc(stats.num_prefill_tokens)
        self.step_tokens.labels(phase="decode").inc(stats.num_decode_tokens)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_free.set(stats.kv_blocks_free)
        self.step_time.observe(stats.step_ms / 1000.0)

    def on_row(self, row: RowOutcome) -> None:
        self.rows.labels(finish_reason=row.finish_reason).inc()
        self.tokens.labels(kind="prompt").inc(row.prompt_tokens)
        self.tokens.labels(kind="completion").inc(row.completion_tokens)
        m = row_metrics(row)
        if m["ttft_s"] is not None:
            self.ttft.observe(m["ttft_s"])
        t = row.times
        if t is not None and t.finished is not None:
            self.latency.observe(max(0.0, t.finished - t.arrived))

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics on host:port in a daemon thread (port 0: any free port); returns the port."""
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e})") from e
        bound = int(self._server.server_port)
        log.info("serving metrics on http://%s:%d/metrics", host, bound)
        return bound

    def stop(self) -> None:
        """Stop the HTTP server, if one runs."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None

    def text(self) -> str:
        """The current metrics in the Prometheus text format."""
        return generate_latest(self.registry).decode()

    def write_textfile(self, path: str | Path) -> Path:
        """Write a node-exporter textfile atomically (temp file in the same folder, fsync, rename)."""
        path = Path(path)
        if path.parent and not path.parent.is_dir():
            raise FileNotFoundError(f"--metrics-textfile {path}: folder {path.parent} does not exist")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(self.text())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        log.info("wrote metrics textfile %s", path)
        return path
