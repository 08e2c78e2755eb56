"""The job driver: plan inputs -> pending rows -> requests -> engine results -> part files.

The stages live in their own modules — plan.py (1: plan the inputs, 2: pending rows), requests.py
(3: rows to requests), results.py (4: results to output rows) — and this one drives them (5: execute)
and runs the whole job. Seams: a data-parallel or Ray executor replaces `_run_pending` (it gets the
same plan and callbacks), metrics hook `on_row` (a per-row timing record) and `on_progress`.

Exactly-once resume: see batchinfer/io/manifest.py for the commit protocol. The finished ids come from
the committed parts; a row whose id is among them is skipped when the input is read again.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from batchinfer.engine.request import Request, Result
from batchinfer.io import manifest as mf
from batchinfer.io.readers import Reject, Row
from batchinfer.io.writer import PartWriter, existing_schema, output_schema
from batchinfer.job.spec import JobError, JobSpec, load_job
from batchinfer.observe import ObserveOptions, Observer
from batchinfer.job.plan import JobPlan, pending_rows, plan_inputs
from batchinfer.job.prompts import RowError
from batchinfer.job.requests import RequestBuilder, RowMeta
from batchinfer.job.results import RESULT_NAMES, ResultConverter

log = logging.getLogger(__name__)




class RunError(RuntimeError):
    """The run itself failed (engine crash, disk full): exit code 1."""


# ---- results of a run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowRecord:
    """Per-row timing record (for metrics): what happened to one row in the engine."""

    row_id: Any
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    times: Any = None  # engine RequestTimes, or None for rows that never reached the engine
    num_preemptions: int = 0
    error: str | None = None  # the output row's error (also set when the answer failed validation)
    result: Result | None = None  # the engine's Result, None for rows that never reached it


@dataclass(frozen=True)
class RunSummary:
    """What a run did. Totals cover the whole job's output folder (all runs), `this_run_*` this run."""

    output_path: str
    input_rows: int  # rows with an id, over all input files
    rows_done: int  # rows committed in the output (all runs)
    error_rows: int  # of those, rows with an error (all runs)
    rejects: int  # input lines with no usable id (see _rejects.jsonl)
    this_run_rows: int = 0
    this_run_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # generation: from the engine being ready to the last part committed
    load_seconds: float = 0.0  # loading the engine (model, KV cache)
    nothing_to_do: bool = False
    recovered_parts: int = 0
    report_path: str | None = None  # the run's `_report.html`, when one was written

    @property
    def error_rate(self) -> float:
        total = self.rows_done + self.rejects
        return (self.error_rows + self.rejects) / total if total else 0.0

    def describe(self) -> str:
        if self.nothing_to_do:
            head = f"nothing to do: all {self.rows_done} rows are already in {self.output_path}"
        else:
            rate = (self.prompt_tokens + self.completion_tokens) / self.seconds if self.seconds else 0.0
            head = (
                f"done: {self.this_run_rows} rows in {self.seconds:.1f}s after {self.load_seconds:.1f}s loading "
                f"({self.this_run_rows / self.seconds if self.seconds else 0:.1f} rows/s, {rate:.0f} tokens/s; "
                f"{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens) -> {self.output_path}"
            )
        tail = f"\noutput holds {self.rows_done} of {self.input_rows} rows; {self.error_rows} with errors"
        if self.rejects:
            tail += f"; {self.rejects} input lines rejected (see {Path(self.output_path) / mf.REJECTS})"
        if self.report_path:
            tail += f"\nreport: {self.report_path}"
        return head + tail


# ---- stage 5: drive the engine -----------------------------------------------------------------------


@dataclass
class Progress:
    """Counters of the running job; `on_progress` callbacks see this after every finished row."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejects: int = 0
    started: float = field(default_factory=time.perf_counter)


def reject_line(r: Reject) -> str:
    return json.dumps({"file": r.file, "line": r.line, "text": r.text, "reason": r.reason}, ensure_ascii=False)


def execute(
    items: Iterable[Row | Reject],
    engine: Any,
    builder: RequestBuilder,
    converter: ResultConverter,
    writer: PartWriter,
    rejects_file: Any,
    progress: Progress,
    on_row: Callable[[RowRecord], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
) -> None:
    """Feed pending rows to the engine lazily; write each result as it finishes.

    Rows that fail before the engine (template, length) are written straight away, from inside the
    request generator (same thread), so memory stays bounded even for a long run of bad rows.
    """
    inflight: dict[str, RowMeta] = {}

    def finish(row: dict[str, Any], record: RowRecord) -> None:
        if on_row:  # before writer.add: a part committed by it then has its rows' records flushed with it
            on_row(record)
        writer.add(row)
        progress.rows += 1
        progress.errors += row["error"] is not None
        progress.prompt_tokens += record.prompt_tokens
        progress.completion_tokens += record.completion_tokens
        if on_progress:
            on_progress(progress)

    def requests() -> Iterator[Request]:
        n = 0
        for item in items:
            if isinstance(item, Reject):
                rejects_file.write(reject_line(item) + "\n")
                progress.rejects += 1
                continue
            meta = RowMeta(builder.keys(item), item.file, item.line)
            rid = str(n)
            n += 1
            try:
                req = builder.build(item, rid)
            except RowError as e:
                msg = f"{e} ({Path(item.file).name} line {item.line})"
                finish(converter.error_row(meta, msg), RowRecord(meta.keys[builder.key_names[0]], "error", 0, 0, error=msg))
                continue
            inflight[rid] = meta
            yield req

    for result in engine.generate(requests()):
        meta = inflight.pop(result.request_id)
        row = converter.row(meta, result)
        record = RowRecord(
            meta.keys[builder.key_names[0]], row["finish_reason"], result.prompt_tokens, result.completion_tokens,
            result.times, result.num_preemptions, row["error"], result,
        )
        finish(row, record)
        writer.maybe_flush()
    if inflight:
        raise RunError(f"the engine ended without results for {len(inflight)} request(s)")


# ---- the whole job ------------------------------------------------------------------------------------


def progress_bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="row", disable=not enabled, dynamic_ncols=True, file=sys.stderr)


def make_engine(spec: JobSpec, on_step: Callable[[Any], None] | None = None):
    from batchinfer.engine.engine import Engine

    return Engine(spec.engine_config(), on_step=on_step)


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
    executor: str = "local",
) -> RunSummary:
    """Run a batch job (path, dict or JobSpec) to completion and return its summary.

    progress: show a tqdm bar on stderr (only when it is a terminal; the CLI turns it on). on_row gets a RowRecord per
    finished row, on_progress the running counters, on_step the engine's per-step stats. Raises JobError/InputError for a
    job that cannot run, RunError (or the engine's exception) when the run fails.

    Observability (batchinfer.observe): step and row records are always kept beside the output, and
    report writes `_report.json` / `_report.html` there at the end. metrics_port serves live Prometheus
    metrics on 127.0.0.1 during the run (0: any free port), metrics_textfile writes a node-exporter
    textfile at the end, log_token_ids writes the `_token_ids/` sidecar, trace_dir a profiler trace.
    """
    spec = load_job(job, overrides)
    observe = observe_options(spec, metrics_port, metrics_textfile, log_token_ids, trace_dir, report)
    runner = pending_runner(spec, executor)
    plan = plan_inputs(spec, overwrite=overwrite)
    try:
        return _run_plan(plan, progress, engine_factory, on_row, on_progress, on_step, observe, runner)
    finally:
        plan.close()


def observe_options(
    spec: JobSpec,
    metrics_port: int | None = None,
    metrics_textfile: str | Path | None = None,
    log_token_ids: bool = False,
    trace_dir: str | Path | None = None,
    report: bool = True,
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
            out_dir=Path(spec.output.path),
            metrics_port=metrics_port,
            metrics_textfile=Path(metrics_textfile) if metrics_textfile is not None else None,
            log_token_ids=log_token_ids,
            trace_dir=Path(trace_dir) if trace_dir is not None else None,
            report=report,
        )
    except ValueError as e:
        raise JobError(f"--metrics-port: {e}") from None


def _chain(*callbacks: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
    """One callback calling each given one in order (None when none is given)."""
    fns = [f for f in callbacks if f is not None]
    if len(fns) <= 1:
        return fns[0] if fns else None

    def call(x: Any) -> None:
        for f in fns:
            f(x)

    return call


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


def _finish_observer(obs: Observer, plan: JobPlan, s: RunSummary) -> RunSummary:
    """Close the observer (report, textfile, trace). The output is committed: a failure here is logged, not raised."""
    facts = {
        "config": plan.spec.model_dump(mode="json"),
        "fingerprint": plan.manifest.fingerprint,
        "components": dict(plan.manifest.components),
        "summary": dataclasses.asdict(s),
    }
    try:
        obs.close(facts)
    except Exception as e:
        log.error("the run's output is complete, but writing its report/metrics failed: %s: %s", type(e).__name__, e)
    if obs.report is not None:
        from batchinfer.observe.report import REPORT_HTML

        s = dataclasses.replace(s, report_path=str(plan.output_dir / REPORT_HTML))
    return s


def _run_plan(
    plan: JobPlan,
    progress: bool,
    engine_factory: Callable[..., Any],
    on_row: Callable[[RowRecord], None] | None,
    on_progress: Callable[[Progress], None] | None,
    on_step: Callable[[Any], None] | None,
    observe: ObserveOptions | None = None,
    runner: Callable[..., RunSummary] | None = None,
) -> RunSummary:
    out = plan.output_dir
    pending = plan.pending_count
    t0 = time.perf_counter()
    rejects_path = out / mf.REJECTS
    if pending == 0:
        rejects = sum(1 for _ in rejects_path.open()) if rejects_path.exists() else 0
        s = summarize(plan, rejects, Progress(), 0.0, nothing_to_do=True)
        log.debug("%s", s.describe())
        return s
    obs = _start_observer(observe)
    if obs is None:
        return (runner or _run_pending)(plan, pending, t0, progress, engine_factory, on_row, on_progress, on_step, None)
    try:
        s = (runner or _run_pending)(
            plan, pending, t0, progress, engine_factory, _chain(obs.on_row, on_row), on_progress,
            _chain(obs.on_step, on_step), lambda part: _flush_records(obs),
        )
    except BaseException:
        try:
            obs.abort()  # keep the records (a resume's report includes them), free the port
        except Exception as e:  # the run's own failure matters more
            log.warning("observer: %s", e)
        raise
    return _finish_observer(obs, plan, s)


def pending_runner(spec: JobSpec, executor: str = "local") -> Callable[..., RunSummary] | None:
    """Who runs the pending rows (same arguments as _run_pending): None is one engine in this process;
    engine.data_parallel > 1 a process per GPU (executors/data_parallel.py); "ray" a Ray cluster."""
    if executor == "ray":
        from batchinfer.job.executors.ray_executor import ray_runner

        return ray_runner(spec)
    if executor != "local":
        raise JobError(f"--executor {executor!r}: use local or ray")
    if spec.engine.data_parallel == 1:
        return None
    from batchinfer.job.executors.data_parallel import data_parallel_runner

    return data_parallel_runner(spec)


def _run_pending(
    plan: JobPlan,
    pending: int,
    t0: float,
    progress: bool,
    engine_factory: Callable[..., Any],
    on_row: Callable[[RowRecord], None] | None,
    on_progress: Callable[[Progress], None] | None,
    on_step: Callable[[Any], None] | None,
    on_commit: Callable[[Any], None] | None,
) -> RunSummary:
    """Load the engine and do the pending rows (the part of a run the observer watches)."""
    spec = plan.spec
    out = plan.output_dir
    rejects_path = out / mf.REJECTS
    log.info("%d of %d rows to do (%d already in %s)", pending, plan.ids.num_rows, plan.ids.num_rows - pending, out)
    constraint = spec.structured.constraint() if spec.structured else None
    engine = engine_factory(spec, on_step=on_step)
    max_len = getattr(engine, "max_model_len", None) or spec.model.max_model_len or engine.model_info.max_position_embeddings
    builder = RequestBuilder(spec, engine.tokenizer, max_len, constraint)
    converter = ResultConverter(spec, constraint)
    columns = output_schema(plan.key_types, converter.output_type)
    if plan.manifest.parts:  # resume output written before a column existed: keep the parts' schema
        names = set(existing_schema(out, plan.manifest.parts[0].name).names)
        columns = {k: v for k, v in columns.items() if k in names or k not in RESULT_NAMES}
    writer = PartWriter(plan.manifest, columns, spec.output.rows_per_part, spec.output.seconds_per_part, on_commit)
    needed = sorted(set(builder.key_names) | set(builder.prompts.columns))
    stats = Progress()
    bar = progress_bar(pending, progress and sys.stderr.isatty())

    def tick(p: Progress) -> None:
        bar.update(1)
        if bar.n % 8 == 0:
            dt = time.perf_counter() - p.started
            bar.set_postfix(tok_s=f"{(p.prompt_tokens + p.completion_tokens) / dt:.0f}" if dt else "-", errors=p.errors, refresh=False)
        if on_progress:
            on_progress(p)

    tmp_rejects = out / f"{mf.TMP_PREFIX}{mf.REJECTS}"
    try:
        with open(tmp_rejects, "w", encoding="utf-8") as rf:
            try:
                execute(pending_rows(plan, needed), engine, builder, converter, writer, rf, stats, on_row, tick)
            except BaseException:
                writer.save_finished()
                raise
            writer.close()
        tmp_rejects.replace(rejects_path)
    finally:
        bar.close()
    s = summarize(plan, stats.rejects, stats, time.perf_counter() - stats.started)
    s = dataclasses.replace(s, load_seconds=stats.started - t0)
    log.debug("%s", s.describe())
    return s


def summarize(plan: JobPlan, rejects: int, stats: Progress, seconds: float, nothing_to_do: bool = False) -> RunSummary:
    m = plan.manifest
    return RunSummary(
        output_path=str(plan.output_dir),
        input_rows=plan.ids.num_rows,
        rows_done=sum(p.rows for p in m.parts),
        error_rows=sum(p.errors for p in m.parts),
        rejects=rejects,
        this_run_rows=stats.rows,
        this_run_errors=stats.errors,
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        seconds=seconds,
        nothing_to_do=nothing_to_do,
        recovered_parts=plan.recovered,
    )
