"""The executor interface: `Executor.run(plan, hooks) -> RunSummary` runs a job's pending rows somewhere."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Protocol, runtime_checkable

from batchinfer.io.manifest import PartInfo
from batchinfer.job.phases import PhaseTimer
from batchinfer.job.plan import JobPlan
from batchinfer.job.progress import ProgressOptions
from batchinfer.job.stop import StopRequest
from batchinfer.job.summary import Progress, RowRecord, RunSummary


@dataclass(frozen=True)
class RunHooks:
    """What the driver hands an executor besides the plan.

    engine_factory(spec, on_step=None) -> engine; executors that start engines in other processes send
    it there, so it must be importable by name. on_row gets a RowRecord per finished row, on_progress
    the running counters, on_step the engine's per-step stats (only where the engine runs in this
    process), on_commit each part once it is committed and in the manifest. progress: a bar on a
    terminal, log lines elsewhere (progress.py). started: when the run started (the summary's
    load_seconds counts from it). stop: the run's StopRequest (job/stop.py), checked between engine
    steps, rows and requests; a stopped run commits what finished and returns its summary with
    `stopped` set. phases: the run's phase timer (start-up spans, first step, ...).
    """

    engine_factory: Callable[..., Any]
    on_row: Callable[[RowRecord], None] | None = None
    on_progress: Callable[[Progress], None] | None = None
    on_step: Callable[[Any], None] | None = None
    on_commit: Callable[[PartInfo], None] | None = None
    progress: ProgressOptions = field(default_factory=ProgressOptions)
    started: float = field(default_factory=time.perf_counter)
    stop: StopRequest | None = None
    phases: PhaseTimer | None = None


@runtime_checkable
class Executor(Protocol):
    """Runs the pending rows of a plan (plan.pending_count > 0) and returns the run's summary.

    Contract: every pending row ends in exactly one committed part recorded in plan.manifest (the
    plan's process is its only writer), input lines without a usable id go to `_rejects.jsonl`, and
    a failure raises (RunError, or the engine's own exception) after committing what did finish, so
    that running the job again resumes. A stop request (hooks.stop) ends it the same way, but it
    returns the summary with `stopped` set.
    """

    name: ClassVar[str]

    def prepare(self, plan: JobPlan, hooks: RunHooks) -> None:
        """Start what can start before the plan's preflight is done (the driver's threads are scanning
        the input meanwhile; `run` follows only if plan.check() passes and rows are pending). The
        local executor loads its engine here; an executor with nothing to start does nothing."""
        ...

    def run(self, plan: JobPlan, hooks: RunHooks) -> RunSummary: ...


def chain_callbacks(*callbacks: Callable[[Any], None] | None) -> Callable[[Any], None] | None:
    """One callback calling each given one in order (None when none is given)."""
    fns = [f for f in callbacks if f is not None]
    if len(fns) <= 1:
        return fns[0] if fns else None

    def call(x: Any) -> None:
        for f in fns:
            f(x)

    return call
