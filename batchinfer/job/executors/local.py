"""The local executor: one engine in this process runs every pending row; this process writes the parts."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, ClassVar

from batchinfer.io.writer import PartWriter
from batchinfer.job.executors.base import RunHooks
from batchinfer.job.plan import JobPlan, pending_rows
from batchinfer.job.stage import execute, output_columns, rejects_file, row_stages
from batchinfer.job.stop import Stopped
from batchinfer.job.summary import Progress, RunSummary, progress_bar, summarize

log = logging.getLogger(__name__)


class LocalExecutor:
    """Load the engine (hooks.engine_factory), stream the pending rows through it, commit parts as they fill."""

    name: ClassVar[str] = "local"

    def run(self, plan: JobPlan, hooks: RunHooks) -> RunSummary:
        spec = plan.spec
        stop = hooks.stop
        engine = hooks.engine_factory(spec, on_step=_chain(hooks.on_step, stop.check if stop is not None else None))
        if stop is not None:
            stop.check()  # a deadline that passed while the model loaded
        stages = row_stages(spec, engine)
        writer = PartWriter(plan.manifest, output_columns(plan), spec.output.rows_per_part, spec.output.seconds_per_part,
                            hooks.on_commit)
        stats = Progress()
        bar = progress_bar(plan.pending_count, hooks.progress_bar)

        def tick(p: Progress) -> None:
            bar.update(1)
            if bar.n % 8 == 0:
                dt = time.perf_counter() - p.started
                bar.set_postfix(tok_s=f"{(p.prompt_tokens + p.completion_tokens) / dt:.0f}" if dt else "-", errors=p.errors,
                                refresh=False)
            if hooks.on_progress:
                hooks.on_progress(p)

        stopped = None
        try:
            with rejects_file(plan.output_dir) as rf:
                try:
                    if stop is not None:
                        stop.in_loop = True
                    execute(pending_rows(plan, stages.read_columns), engine, stages, writer, rf, stats, hooks.on_row, tick,
                            stop.check if stop is not None else None)
                except BaseException:
                    writer.save_finished()
                    raise
                finally:
                    if stop is not None:
                        stop.in_loop = False
                writer.close()
        except Stopped as e:  # the finished rows are committed; the rest is done by the next run
            stopped = e.reason
            log.warning("stopping: %s; %d finished rows of this run are committed", e.reason, writer.rows_written)
            stats.rows, stats.errors = writer.rows_written, writer.errors_written
        finally:
            bar.close()
        return summarize(plan, stats.rejects, stats, time.perf_counter() - stats.started,
                         load_seconds=stats.started - hooks.started, stopped=stopped)


def _chain(*callbacks: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
    """One callback calling each given one in order (None when none is given)."""
    fns = [f for f in callbacks if f is not None]
    if len(fns) <= 1:
        return fns[0] if fns else None

    def call(x: Any) -> None:
        for f in fns:
            f(x)

    return call
