"""The whole job: load the spec, plan the inputs, pick the executor by name, observe the run, summarise it.

The stages live in their own modules: plan.py (1: plan the inputs, 2: pending rows), requests.py (3:
rows to requests), results.py (4: results to output rows), stage.py (5: execute them with one engine);
an executor (executors/, chosen by name) runs stage 5 somewhere and returns the RunSummary
(summary.py). This module only drives: it never asks which executor it has.

Exactly-once resume: see batchinfer/io/manifest.py for the commit protocol. The finished ids come from
the committed parts; a row whose id is among them is skipped when the input is read again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

from batchinfer.io import layout
from batchinfer.job.executors import executor_for
from batchinfer.job.executors.base import Executor, RunHooks, chain_callbacks
from batchinfer.job.phases import PhaseTimer
from batchinfer.job.plan import JobPlan, plan_inputs
from batchinfer.job.progress import ProgressOptions
from batchinfer.job.spec import JobError, JobSpec, load_job
from batchinfer.job.stage import make_engine
from batchinfer.job.stop import EXIT_STOPPED, StopRequest, parse_duration
from batchinfer.job.summary import Progress, RowRecord, RunSummary, summarize
from batchinfer.observe import ObserveOptions, Observer

log = logging.getLogger(__name__)


def run_job(
    job: "str | Path | dict[str, Any] | JobSpec",
    overrides: list[str] | tuple[str, ...] = (),
    overwrite: bool = False,
    progress: bool = False,
    engine_factory: Callable[..., Any] = make_engine,
    on_row: Callable[[RowRecord], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    on_step: Callable[[Any], None] | None = None,
    *,
    metrics_port: int | None = None,
    metrics_textfile: str | Path | None = None,
    log_token_ids: bool = False,
    trace_dir: str | Path | None = None,
    report: bool = True,
    report_page: str = "inline",
    executor: str = "local",
    stop_after: "str | float | None" = None,
    handle_signals: bool = False,
    stop: StopRequest | None = None,
    progress_interval: float = 30.0,
    phases: PhaseTimer | None = None,
    on_summary: Callable[[RunSummary], None] | None = None,
) -> RunSummary:
    """Run a batch job (path, dict or JobSpec) to completion and return its summary.

    Stopping early (job/stop.py): stop_after ('90m', '2h', seconds) is a deadline after which the run
    stops gracefully; handle_signals=True makes SIGINT/SIGTERM do the same while the run lasts (main
    thread only; the previous handlers come back after); or pass a StopRequest whose signals are
    handled by the caller (the CLI: SignalHandlers). A stopped run returns its summary with `stopped`
    set, its finished rows committed.

    progress: show it on stderr: a tqdm bar when stderr is a terminal, else a log line (logger
    `batchinfer.progress`) every progress_interval seconds (the CLI turns it on). on_row gets a
    RowRecord per finished row, on_progress the running counters, on_step the engine's per-step
    stats, on_summary the summary as soon as every row is committed, before the report is written
    (the CLI prints it there). Raises JobError/InputError for a job that cannot run, RunError (or the
    engine's exception) when the run fails.

    Start-up overlaps: on a fresh output the id scan, and always the tokenizer and the grammar compile,
    run on threads while the engine loads (plan.py, preflight.py); their errors are raised before any
    row is processed. phases: a PhaseTimer to record into (the CLI's, which knows when the process
    started); the returned summary's `phases` holds what it recorded.

    Observability (batchinfer.observe): step and row records are always kept beside the output, and
    report writes `_report.json` / `_report.html` there at the end (report_page "detached": the page
    by a process of its own, observe/page_writer.py, so the caller need not wait for it). metrics_port serves live Prometheus
    metrics on 127.0.0.1 during the run (0: any free port), metrics_textfile writes a node-exporter
    textfile at the end, log_token_ids writes the `_token_ids/` sidecar, trace_dir a profiler trace.

    executor: who runs the rows, by name (batchinfer/job/executors/__init__.py): local (this host:
    engine.data_parallel engines), data_parallel (engine processes even for one), ray (a Ray cluster).
    """
    if stop is None and (stop_after is not None or handle_signals):
        stop = StopRequest(parse_duration(stop_after))
        handlers = SignalHandlers(stop).install() if handle_signals else None
        try:
            return run_job(job, overrides, overwrite, progress, engine_factory, on_row, on_progress, on_step,
                           metrics_port=metrics_port, metrics_textfile=metrics_textfile, log_token_ids=log_token_ids,
                           trace_dir=trace_dir, report=report, report_page=report_page, executor=executor, stop=stop,
                           progress_interval=progress_interval, phases=phases, on_summary=on_summary)
        finally:
            if handlers is not None:
                handlers.uninstall()
    timer = phases if phases is not None else PhaseTimer()
    timer.mark("run_job")
    with timer.span("load_job"):
        spec = load_job(job, overrides)
    if executor != "ray":
        check_device(spec.engine.device)
    observe = observe_options(spec, metrics_port, metrics_textfile, log_token_ids, trace_dir, report, report_page)
    try:
        shown = ProgressOptions(progress, progress_interval)
    except ValueError as e:
        raise JobError(f"--progress-interval: {e}") from None
    chosen = executor_for(executor, spec)  # an unknown name, or no Ray, is refused before planning
    pool = ThreadPoolExecutor(max_workers=3, thread_name_prefix="preflight")
    try:
        with timer.span("plan"):
            plan = plan_inputs(spec, overwrite=overwrite, pool=pool, phases=timer)
        if observe.report and observe.page == "inline":
            pool.submit(_import_report_page)  # matplotlib takes a second or more to import: not after the run
        try:
            hooks = RunHooks(engine_factory, on_row, on_progress, on_step, progress=shown, stop=stop, phases=timer)
            s = _run_plan(plan, chosen, hooks, observe, on_summary)
        finally:
            plan.close()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # after an early error, a scan still running ends by itself
    timer.mark("run_job_end")
    return dataclasses.replace(s, phases=timer.as_dict())


class SignalHandlers:
    """SIGINT and SIGTERM request a graceful stop of a run (its StopRequest; see job/stop.py).

    The first signal asks the run to stop; a SECOND one (or any signal once the run is over, e.g. while
    the process joins its threads) ends the process at once with os._exit(exit_code) and one line on
    stderr, never a traceback: the commit protocol makes an exit at any moment safe.
    """

    def __init__(self, stop: StopRequest, exit_code: int = EXIT_STOPPED) -> None:
        self.stop = stop
        self.exit_code = exit_code
        self._saved: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.stop.reason is not None:
            try:
                os.write(2, f"\nerror: {name} received again: exiting now; what is committed is kept; "
                            "run the same command again to resume\n".encode())
            finally:
                os._exit(self.exit_code)
        self.stop.request(f"{name} received")

    def install(self) -> "SignalHandlers":
        """Handle SIGINT and SIGTERM (main thread only; elsewhere Python cannot, and this is a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._on_signal)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, old in self._saved.items():
            signal.signal(sig, old)
        self._saved.clear()


def check_device(device: str) -> None:
    """Refuse an engine.device this machine does not have (the user's error: JobError, exit 2)."""
    if not device.startswith("cuda"):
        return
    import torch

    if not torch.cuda.is_available():
        raise JobError(f"engine.device is {device!r} but this machine has no usable CUDA GPU "
                       "(torch.cuda.is_available() is False); use engine.device: cpu or auto")
    _, _, index = device.partition(":")
    if index.isdigit() and int(index) >= torch.cuda.device_count():
        raise JobError(f"engine.device is {device!r} but only {torch.cuda.device_count()} CUDA GPU(s) are visible")


def observe_options(
    spec: JobSpec,
    metrics_port: int | None = None,
    metrics_textfile: str | Path | None = None,
    log_token_ids: bool = False,
    trace_dir: str | Path | None = None,
    report: bool = True,
    report_page: str = "inline",
) -> ObserveOptions:
    """The run's ObserveOptions (records and report in output.path); checked before anything loads."""
    if metrics_textfile is not None:
        tf = Path(metrics_textfile)
        if tf.is_dir():
            raise JobError(f"--metrics-textfile {tf}: is a folder; give a file path (e.g. {tf / 'batchinfer.prom'})")
        if not tf.parent.is_dir():
            raise JobError(f"--metrics-textfile {tf}: folder {tf.parent} does not exist")
    if trace_dir is not None and Path(trace_dir).exists() and not Path(trace_dir).is_dir():
        raise JobError(f"--trace {trace_dir}: is a file, not a folder")
    try:
        return ObserveOptions(
            out_dir=spec.output.path,
            metrics_port=metrics_port,
            metrics_textfile=Path(metrics_textfile) if metrics_textfile is not None else None,
            log_token_ids=log_token_ids,
            trace_dir=Path(trace_dir) if trace_dir is not None else None,
            report=report,
            page=report_page,
        )
    except ValueError as e:
        raise JobError(f"--metrics-port: {e}") from None


def _start_observer(options: ObserveOptions | None) -> Observer | None:
    """The run's Observer; a port that cannot be served is the user's error (JobError, exit 2)."""
    if options is None:
        return None
    try:
        return Observer(options)
    except OSError as e:
        raise JobError(str(e)) from None


def _flush_records(obs: Observer) -> None:
    """After an output part is committed: write the run records with it (a kill then loses neither)."""
    try:
        obs.flush()
    except Exception as e:  # records are a by-product; the output must go on
        log.warning("could not write run records: %s", e)


def _finish_observer(obs: Observer, plan: JobPlan, s: RunSummary, phases: PhaseTimer | None) -> RunSummary:
    """Close the observer (report, textfile, trace). The output is committed: a failure here is logged, not raised."""
    facts = {
        "config": plan.spec.model_dump(mode="json"),
        "fingerprint": plan.manifest.fingerprint,
        "components": dict(plan.manifest.components),
        "summary": dataclasses.asdict(dataclasses.replace(s, phases=phases.as_dict() if phases is not None else None)),
    }
    t = time.perf_counter()
    try:
        obs.close(facts)
    except Exception as e:
        log.error("the run's output is complete, but writing its report/metrics failed: %s: %s", type(e).__name__, e)
    if phases is not None:
        phases.add("report", t, time.perf_counter())
    report = str(layout.report_html_path(plan.output_dir)) if obs.report is not None else None
    s = dataclasses.replace(s, report_path=report)
    return s


def _import_report_page() -> None:
    """Import the report page's plotting code (matplotlib) ahead of the report (on a preflight thread)."""
    try:
        import batchinfer.observe.page  # noqa: F401
    except Exception as e:  # the report says so when it is written
        log.debug("could not import the report page: %s", e)


def _first_step_marker(phases: PhaseTimer | None) -> Callable[[Any], None] | None:
    """An on_step callback that marks the run's first engine step (then does nothing)."""
    if phases is None:
        return None
    seen: list[bool] = []

    def on_step(_stats: Any) -> None:
        if not seen:
            seen.append(True)
            phases.mark("first_step")

    return on_step


def _nothing_to_do(plan: JobPlan) -> RunSummary:
    rejects = layout.rejects_path(plan.output_dir).count_lines()
    s = summarize(plan, rejects, Progress(), 0.0, nothing_to_do=True)
    write_output_formats(plan, changed=False)
    log.debug("%s", s.describe())
    return s


def _run_plan(
    plan: JobPlan,
    executor: Executor,
    hooks: RunHooks,
    observe: ObserveOptions | None = None,
    on_summary: Callable[[RunSummary], None] | None = None,
) -> RunSummary:
    """Start the engine while the preflight finishes, run the pending rows, summarise, then report.

    A resumed output (or an input without a row) knows its pending rows first: with nothing pending,
    no engine is loaded at all."""
    phases = hooks.phases
    out = plan.output_dir
    if (plan.resumes or not plan.may_have_rows) and plan.pending_count == 0:
        return _nothing_to_do(plan)
    obs = _start_observer(observe)
    watched = hooks
    if obs is not None:
        watched = dataclasses.replace(
            hooks, on_row=chain_callbacks(obs.on_row, hooks.on_row), on_step=chain_callbacks(obs.on_step, hooks.on_step),
            on_commit=lambda part: _flush_records(obs),
        )
    watched = dataclasses.replace(watched, on_step=chain_callbacks(_first_step_marker(phases), watched.on_step))
    try:
        executor.prepare(plan, watched)  # the local executor loads its engine, the preflight threads go on
        with phases.span("preflight_wait") if phases is not None else nullcontext():
            plan.check()  # a duplicate id or a schema no backend compiles: before any row
        pending = plan.pending_count
        if pending == 0:  # input files without a single usable row
            if obs is not None:
                obs.abort()
            return _nothing_to_do(plan)
        log.info("%d of %d rows to do (%d already in %s); executor: %s", pending, plan.ids.num_rows,
                 plan.ids.num_rows - pending, out, executor.name)
        s = executor.run(plan, watched)
    except BaseException:
        if obs is not None:
            try:
                obs.abort()  # keep the records (a resume's report includes them), free the port
            except Exception as e:  # the run's own failure matters more
                log.warning("observer: %s", e)
        raise
    write_output_formats(plan)
    if obs is not None and obs.options.report:
        from batchinfer.io.layout import report_html_path

        s = dataclasses.replace(s, report_path=str(report_html_path(out)))  # written next, after on_summary
    if phases is not None:
        phases.mark("summary")
        s = dataclasses.replace(s, phases=phases.as_dict())
    if on_summary is not None:
        on_summary(s)
    if obs is not None:
        s = _finish_observer(obs, plan, s, phases)
    log.debug("%s", s.describe())
    return s


def write_output_formats(plan: JobPlan, changed: bool = True) -> None:
    """output.format openai: results.jsonl / errors.jsonl from the committed parts (io/openai_batch.py);
    unless `changed`, only when they are missing or behind the parts (a kill while they were written)."""
    if plan.spec.output.format != "openai":
        return
    from batchinfer.io import openai_batch
    from batchinfer.job.results import TokenTexts
    from batchinfer.models.loader import load_tokenizer

    m = plan.manifest
    if not changed and openai_batch.up_to_date(plan.output_dir, sum(p.rows for p in m.parts)):
        return
    piece = TokenTexts(load_tokenizer(plan.model_dir) if plan.spec.sampling.logprobs is not None else None)
    ok, bad = openai_batch.write_output_files(
        plan.output_dir, m.part_locations, plan.spec.input.id_column, m.fingerprint, model_name(plan.spec), piece
    )
    log.info("wrote %s (%d lines) and %s (%d lines)", openai_batch.RESULTS, ok, openai_batch.ERRORS, bad)


def model_name(spec: JobSpec) -> str:
    """The model's name in OpenAI-shaped output: its folder's name, or the hub id."""
    path = Path(spec.model.path)
    return path.name if path.is_dir() else spec.model.path

