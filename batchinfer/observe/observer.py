"""The Observer: what the job driver creates from the run's options and feeds with steps and results.

It fans each event out to the parts that are on:
  always   step and row records beside the output (records.py; where: io/layout.py), the report at
           close (report.py);
  options  live Prometheus metrics on a port and/or a textfile (metrics.py), the token-id sidecar
           (tokenlog.py), a profiler trace of a few steps (trace.py).

Driver use (make the Observer after the output folder is planned, i.e. after --overwrite cleared it:
an output folder with no committed part gets its old records removed, a resumed one keeps them):
    obs = Observer(ObserveOptions(out_dir=..., metrics_port=..., ...))
    engine = Engine(config, on_step=obs.on_step)
    for result in engine.generate(requests): ...; obs.on_result(row_id, result)   # or obs.on_row(record)
    report = obs.close({"config": resolved_job, "fingerprint": fp})
A failing observer part must never lose rows: close() tries every part and logs what failed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchinfer.engine.request import Result
from batchinfer.engine.stats import StepStats
from batchinfer.io import layout
from batchinfer.io.manifest import Manifest, part_files
from batchinfer.observe.metrics import Metrics
from batchinfer.observe.records import (
    ROW_SCHEMA,
    STEP_SCHEMA,
    PartSink,
    RowOutcome,
    SinkConfig,
    new_run_id,
    row_record,
    step_record,
)
from batchinfer.observe.report import summary_text, write_report_json, write_report_page
from batchinfer.observe.tokenlog import TokenLog
from batchinfer.observe.trace import StepTracer, TraceConfig

log = logging.getLogger(__name__)

# Input excerpts kept in the row records, per run: the first rows that succeeded and the first rows of
# each error kind (enough for the report's sample answers; the records stay small on long runs).
EXCERPT_OK_ROWS = 20
EXCERPT_ROWS_PER_ERROR_KIND = 5
PAGE_MODES = ("inline", "detached")  # ObserveOptions.page


@dataclass(frozen=True)
class ObserveOptions:
    """What to observe. out_dir: the job's output folder, a path or URI (records and the report go to its
    records folder beside it: io/layout.py).

    metrics_port: serve live metrics on metrics_host:port (0: any free port; None: off).
    metrics_textfile: write a node-exporter textfile there at close (None: off).
    log_token_ids: write `token_ids/` (prompt and output ids of every row).
    trace_dir: write a profiler trace of trace_num_steps steps after step trace_start_step (None: off).
    report: write `report.json` and `report.html` at close.
    page: "inline" draws `report.html` in close; "detached" leaves it to a process of its own started
      there (observe/page_writer.py: `batchinfer run` does, so its exit waits for no plot).
    flush_rows / flush_s: how often records are written out as parts.
    """

    out_dir: Any  # str | Path | Location
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    metrics_textfile: Path | None = None
    log_token_ids: bool = False
    trace_dir: Path | None = None
    trace_start_step: int = 5
    trace_num_steps: int = 3
    report: bool = True
    page: str = "inline"
    flush_rows: int = 10_000
    flush_s: float = 60.0

    def __post_init__(self) -> None:
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535], not {self.metrics_port}")
        if self.flush_rows < 1:
            raise ValueError("flush_rows must be at least 1")
        if self.page not in PAGE_MODES:
            raise ValueError(f"page must be one of {', '.join(PAGE_MODES)}, not {self.page!r}")


class Observer:
    """Fans on_step / on_result / close out to the enabled observability parts."""

    def __init__(self, options: ObserveOptions) -> None:
        self.options = options
        self.out_dir = layout.output_dir(options.out_dir)
        self.out_dir.makedirs()
        layout.records_dir(self.out_dir).makedirs()
        tf = options.metrics_textfile
        if tf is not None and not Path(tf).parent.is_dir():  # say so now, not at the end of a long run
            raise FileNotFoundError(f"--metrics-textfile {tf}: folder {Path(tf).parent} does not exist")
        if not _has_committed_parts(self.out_dir):
            clear_records(self.out_dir)  # a fresh job (or --overwrite): old records describe other rows
        self.run_id = new_run_id()
        self.t0 = time.perf_counter()
        o = options
        self._steps = PartSink(SinkConfig(layout.steps_dir(self.out_dir), STEP_SCHEMA, self.run_id, o.flush_rows, o.flush_s))
        self._rows = PartSink(SinkConfig(layout.rows_dir(self.out_dir), ROW_SCHEMA, self.run_id, o.flush_rows, o.flush_s))
        self._excerpts: dict[str | None, int] = {}  # error kind (None: ok rows) -> excerpts kept
        self.metrics = Metrics() if (o.metrics_port is not None or o.metrics_textfile is not None) else None
        self.metrics_port: int | None = None
        if self.metrics is not None and o.metrics_port is not None:
            self.metrics_port = self.metrics.serve(o.metrics_port, o.metrics_host)
        self.token_log = TokenLog(self.out_dir, self.run_id, flush_s=o.flush_s) if o.log_token_ids else None
        self.tracer = (
            StepTracer(TraceConfig(Path(o.trace_dir), o.trace_start_step, o.trace_num_steps)) if o.trace_dir else None
        )
        self.closed = False
        self.report: dict[str, Any] | None = None
        self._frames: list[Any] = []  # the step and row frames of report.json, for the page
        log.debug("observer %s on %s", self.run_id, self.out_dir)

    def on_step(self, stats: StepStats) -> None:
        """The engine's step callback."""
        self._steps.add(step_record(self.run_id, stats, self.t0))
        if self.metrics is not None:
            self.metrics.on_step(stats)
        if self.tracer is not None:
            self.tracer.on_step(stats)

    def on_result(self, row_id: Any, result: Result, finish_reason: str | None = None,
                  error: str | None = None, excerpt: str | None = None) -> None:
        """One finished row, from the engine's Result (finish_reason / error: the output row's, when the
        driver changed them, e.g. an answer that fails its schema; excerpt: the start of its input)."""
        row = RowOutcome.of_result(row_id, result, finish_reason, error)
        self._row(dataclasses.replace(row, excerpt=excerpt) if excerpt is not None else row, result)

    def on_row(self, record: Any) -> None:
        """One finished row, from the driver's run.RowRecord (row_id, finish_reason, prompt_tokens,
        completion_tokens, times, num_preemptions; and `error`, `result` when it has them). Rows that
        failed before the engine (no `result`) are counted but have no token ids to log; `excerpt`, when
        the record has one, is kept for the first rows of each outcome (EXCERPT_OK_ROWS ...)."""
        self._row(RowOutcome.of_record(record), getattr(record, "result", None))

    def _row(self, row: RowOutcome, result: Result | None) -> None:
        self._rows.add(row_record(self.run_id, row, self.t0, self._keep_excerpt(row)))
        if self.metrics is not None:
            self.metrics.on_row(row)
        if self.token_log is not None and result is not None:
            self.token_log.add(row.row_id, result)

    def _keep_excerpt(self, row: RowOutcome) -> bool:
        if row.excerpt is None:
            return False
        kind = row.kind
        limit = EXCERPT_OK_ROWS if kind is None else EXCERPT_ROWS_PER_ERROR_KIND
        kept = self._excerpts.get(kind, 0)
        if kept >= limit:
            return False
        self._excerpts[kind] = kept + 1
        return True

    def flush(self) -> None:
        """Write buffered records now (e.g. right after the driver commits an output part)."""
        self._steps.flush()
        self._rows.flush()
        if self.token_log is not None:
            self.token_log.close()

    def close(self, summary: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Flush everything, write the report and textfile, stop the server; returns the report dict.

        summary: the driver's facts about the run (e.g. config: the resolved job, fingerprint, and any
        counts it keeps); stored under the report's `config`/`fingerprint`/`run` keys.
        """
        if self.closed:
            return self.report
        self.closed = True
        summary = dict(summary or {})
        summary.setdefault("run_id", self.run_id)
        summary.setdefault("elapsed_s", time.perf_counter() - self.t0)
        steps = [self._steps.compact, self._rows.compact]
        if self.token_log is not None:
            steps.append(self.token_log.compact)
        if self.tracer is not None:
            steps.append(self.tracer.close)
        # what other tools read first (report.json, the textfile), the page with its plots last
        if self.options.report:
            steps.append(lambda: self._write_report_json(summary))
        if self.metrics is not None and self.options.metrics_textfile is not None:
            steps.append(lambda: self.metrics.write_textfile(self.options.metrics_textfile))  # type: ignore[union-attr]
        if self.metrics is not None:
            steps.append(self.metrics.stop)
        if self.options.report:
            steps.append(self._write_report_page)
        failed = None
        for step in steps:
            try:
                step()
            except Exception as e:  # one broken part must not hide the others' output
                log.exception("observer: %s failed", getattr(step, "__name__", "a part"))
                failed = failed or e
        if failed is not None:
            raise failed
        return self.report

    def _write_report_json(self, summary: dict[str, Any]) -> None:
        self.report, *self._frames = write_report_json(self.out_dir, summary)
        log.info("%s", summary_text(self.report))

    def _write_report_page(self) -> None:
        if self.report is None:  # report.json failed (logged): no page from half a report
            return
        steps, rows = self._frames
        self._frames = []
        if self.options.page == "detached":
            from batchinfer.observe.page_writer import start_detached

            start_detached(self.out_dir)  # from report.json, which is written
            return
        write_report_page(self.out_dir, self.report, steps, rows)

    def abort(self) -> None:
        """The run failed: keep its records (the resumed run's report includes them), write no report,
        free the metrics port."""
        if self.closed:
            return
        self.closed = True
        try:
            self.flush()
            if self.tracer is not None:
                self.tracer.close()
        finally:
            if self.metrics is not None:
                self.metrics.stop()

    def __enter__(self) -> "Observer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _has_committed_parts(out_dir: Any) -> bool:
    manifest = Manifest.load(out_dir)
    return bool(manifest and manifest.parts) or bool(part_files(out_dir))


def clear_records(out_dir: Any) -> None:
    """Remove what observers left for out_dir (records, token ids, report); nothing else is touched."""
    for folder in layout.observer_folders(out_dir):
        folder.delete_tree()
    for path in layout.observer_files(out_dir):
        path.delete()
