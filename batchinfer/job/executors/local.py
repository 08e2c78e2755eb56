"""The local executor: one engine in this process runs every pending row; this process writes the parts.

Its engine loads in `prepare`, while the driver's preflight threads scan the input and load the
tokenizer and grammar (the engine then takes those instead of loading them again). While it runs,
stage 3 (render, tokenise) runs ahead on a thread pool (prefetch.py) and parts are committed on a
background thread (io/background_writer.py): the engine's loop only schedules, steps and converts.
"""

from __future__ import annotations

import logging
import time
from typing import Any, ClassVar

from batchinfer.engine.device_runtime import start_device_runtime
from batchinfer.io.background_writer import BackgroundPartWriter
from batchinfer.job.executors.base import RunHooks, chain_callbacks
from batchinfer.job.phases import add_spans
from batchinfer.job.plan import JobPlan, pending_rows
from batchinfer.job.progress import ProgressDisplay
from batchinfer.job.stage import execute, make_engine, output_columns, rejects_file, row_stages, start_prompts
from batchinfer.job.stop import Stopped
from batchinfer.job.summary import Progress, RunSummary, summarize

log = logging.getLogger(__name__)


def _make_engine(plan: JobPlan, hooks: RunHooks) -> Any:
    """The run's engine. Our own factory takes the preflight's tokenizer and grammar compiler (Futures:
    the engine waits for them only where it needs them); a caller's factory builds its own engine."""
    stop = hooks.stop
    on_step = chain_callbacks(hooks.on_step, stop.check if stop is not None else None)
    t = time.perf_counter()
    if hooks.engine_factory is make_engine:
        engine = make_engine(plan.spec, on_step, tokenizer=plan.preflight.tokenizer, grammar_compiler=plan.preflight.grammar)
    else:
        engine = hooks.engine_factory(plan.spec, on_step=on_step)
    if hooks.phases is not None:
        hooks.phases.add("engine_start", t, time.perf_counter())
        add_spans(hooks.phases, getattr(engine, "startup_spans", ()), prefix="engine.")
    return engine


def _close_prompts(prompts: Any, ahead: Any) -> None:
    """Stop a stage 3 that was started ahead (start_prompts) and will not be run."""
    if ahead is None and prompts is not None:
        try:
            ahead = prompts.result(timeout=10.0)
        except BaseException:  # noqa: BLE001 (it failed to start: nothing runs)
            return
    if ahead is not None:
        ahead.close()


class LocalExecutor:
    """Load the engine (hooks.engine_factory), stream the pending rows through it, commit parts as they fill."""

    name: ClassVar[str] = "local"

    def __init__(self) -> None:
        self._engine: Any = None
        self._prompts: Any = None  # Future of stage 3 started in prepare (stage.start_prompts)

    def prepare(self, plan: JobPlan, hooks: RunHooks) -> None:
        """Load the engine now (this thread), while the plan's preflight runs on its threads and stage 3
        starts preparing the first rows (so the first step finds them ready)."""
        if self._engine is None:
            if hooks.engine_factory is make_engine:  # our engine: its GPU's runtime starts beside the imports
                start_device_runtime(plan.spec.engine.device)
            if self._prompts is None:
                self._prompts = start_prompts(plan)
            self._engine = _make_engine(plan, hooks)

    def run(self, plan: JobPlan, hooks: RunHooks) -> RunSummary:
        spec = plan.spec
        stop = hooks.stop
        prompts, self._prompts = self._prompts, None
        ahead = None
        try:
            engine, self._engine = self._engine if self._engine is not None else _make_engine(plan, hooks), None
            if stop is not None:
                stop.check()  # a deadline that passed while the model loaded
            ahead = prompts.result() if prompts is not None else None
            stages = row_stages(spec, engine, tokenizer=plan.preflight.tokenizer.result())
            writer = BackgroundPartWriter(plan.manifest, output_columns(plan), spec.output.rows_per_part,
                                          spec.output.seconds_per_part, hooks.on_commit)
        except BaseException:
            _close_prompts(prompts, ahead)
            raise
        stats = Progress()
        display = ProgressDisplay(plan.pending_count, stats, hooks.progress)
        phases = hooks.phases
        if phases is not None:
            phases.mark("engine_ready", stats.started)

        def tick(p: Progress) -> None:
            if phases is not None and p.rows == 1:
                phases.mark("first_row_done")
            display.update()
            if hooks.on_progress:
                hooks.on_progress(p)

        stopped = None
        try:
            with rejects_file(plan.output_dir) as rf:
                try:
                    if stop is not None:
                        stop.in_loop = True
                    execute(pending_rows(plan, stages.read_columns), engine, stages, writer, rf, stats, hooks.on_row, tick,
                            stop.check if stop is not None else None, ahead=ahead)
                except BaseException:
                    writer.save_finished()
                    raise
                finally:
                    if stop is not None:
                        stop.in_loop = False
                if phases is not None:
                    phases.mark("last_row_done")
                writer.close()
        except Stopped as e:  # the finished rows are committed; the rest is done by the next run
            stopped = e.reason
            log.warning("stopping: %s; %d finished rows of this run are committed", e.reason, writer.rows_written)
            stats.rows, stats.errors = writer.rows_written, writer.errors_written
        finally:
            display.close()
        if phases is not None:
            phases.mark("parts_committed")
        return summarize(plan, stats.rejects, stats, time.perf_counter() - stats.started,
                         load_seconds=stats.started - hooks.started, stopped=stopped)
