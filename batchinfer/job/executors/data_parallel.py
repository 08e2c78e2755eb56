"""The data-parallel executor: one engine process per GPU of this host (`engine.data_parallel`), one output folder.

The coordinator (this module, in the `batchinfer run` process, which holds the output lock) is the
manifest's only writer. It reads the pending rows (the same anti-join as a single-engine run), cuts them into work
units of a few rows and hands them out dynamically: each worker is kept `prefetch_units` units ahead,
so a fast worker takes more. Workers (`dp_worker.py`) commit part files themselves and report each
part with its ids; the coordinator records it in the manifest.

A worker that dies (SIGKILL, OOM killer, a crashed driver library): its committed-but-unreported parts
are recovered from the folder (`manifest.recover`), and its other rows, which are in no committed
part, go to the other workers. No row is lost or written twice. The run fails (exit 1; run again to
resume) only when no worker is left, or when a worker raised an error (a bug or a bad configuration
would only kill the next worker too); the other workers then finish and commit what they hold first.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any, Callable, ClassVar, Iterator

from batchinfer.io import layout
from batchinfer.io import manifest as mf
from batchinfer.io.readers import Reject, Row
from batchinfer.job.executors.base import RunHooks
from batchinfer.job.executors.dp_worker import WorkerArgs, worker_main
from batchinfer.job.executors.parts import infer_types, part_ids
from batchinfer.job.plan import JobPlan, pending_rows
from batchinfer.job.spec import JobError, JobSpec
from batchinfer.job.stage import RunError, output_columns, read_columns, reject_line, rejects_file, template_columns
from batchinfer.job.progress import ProgressDisplay
from batchinfer.job.stop import StopRequest, Stopped
from batchinfer.job.summary import Progress, RunSummary, summarize

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0
WORKER_NAME = "batchinfer-dp-"  # engine worker processes are named WORKER_NAME + index


def live_workers() -> list[mp.process.BaseProcess]:
    """This process's running engine workers, by index."""
    return sorted((p for p in mp.active_children() if p.name.startswith(WORKER_NAME)), key=lambda p: p.name)


def sigkill_workers_after(after_rows: int, how_many: int) -> tuple[Callable[[Any], None], list[int]]:
    """A fault drill: an `on_progress` hook for batchinfer.run that SIGKILLs the first `how_many`
    live engine workers once `after_rows` rows have finished, and the list it appends their pids to.
    The job must still end with every id exactly once (the rest re-queued, or after a resume)."""
    killed: list[int] = []

    def hook(progress: Progress) -> None:
        if killed or progress.rows < after_rows:
            return
        for p in live_workers()[:how_many]:
            os.kill(p.pid, signal.SIGKILL)
            killed.append(p.pid)

    return hook, killed


@dataclass(frozen=True)
class DataParallelPlan:
    """How many workers, and where each runs.

    gpus: the CUDA_VISIBLE_DEVICES value of each worker, or None for CPU workers.
    unit_rows: rows per work unit; prefetch_units: units a worker holds ahead of its engine.
    """

    workers: int
    gpus: tuple[str, ...] | None
    unit_rows: int
    prefetch_units: int = 3


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None and env.strip():
        return [x.strip() for x in env.split(",") if x.strip()][:n]
    return [str(i) for i in range(n)]


def plan_data_parallel(spec: JobSpec, gpus: list[str] | None = None) -> DataParallelPlan:
    """engine.data_parallel -> workers: `auto` is one per visible GPU (1 on CPU); N > GPUs is an error."""
    want = spec.engine.data_parallel
    device = spec.engine.device
    gpus = visible_gpus() if gpus is None else gpus
    on_gpu = device != "cpu" and bool(gpus)
    if device.startswith("cuda") and not gpus:
        raise JobError(f"engine.device is {device} but no CUDA GPU is visible")
    if want == "auto":
        n = len(gpus) if on_gpu else 1
    else:
        n = int(want)
        if on_gpu and n > len(gpus):
            raise JobError(f"engine.data_parallel is {n} but only {len(gpus)} GPU(s) are visible ({', '.join(gpus)})")
    unit = max(1, min(256, spec.engine.max_num_seqs // 2))
    return DataParallelPlan(n, tuple(gpus[:n]) if on_gpu else None, unit)


@dataclass
class _Worker:
    """The driver's view of one worker."""

    index: int
    process: Any
    tasks: Any  # Connection: driver -> worker
    reports: Any  # Connection: worker -> driver
    alive: bool = True
    ready: bool = False
    exited: bool = False  # said "exit": clean end
    unpulled: int = 0  # units sent but not yet taken into the engine's stream
    needs_drain: bool = False
    outstanding: dict[str, Row] = field(default_factory=dict)  # id -> row: sent, not yet in a committed part
    load_s: float = 0.0


@dataclass
class Outcome:
    """What the workers did, for the run summary."""

    rows: int = 0  # committed this run
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejects: int = 0
    load_seconds: float = 0.0
    worker_deaths: int = 0


class Coordinator:
    """Hands out units, records reported parts, recovers from dead workers (see module docstring)."""

    def __init__(
        self,
        plan: JobPlan,
        dp: DataParallelPlan,
        columns: dict[str, Any],
        items: Iterator[Row | Reject],
        rejects_file: Any,
        engine_factory: Callable[..., Any],
        on_record: Callable[[Any], None] | None = None,
        on_commit: Callable[[mf.PartInfo], None] | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        self.plan = plan
        self.dp = dp
        self.columns = columns
        self.items = items
        self.rejects_file = rejects_file
        self.engine_factory = engine_factory
        self.on_record = on_record
        self.on_commit = on_commit
        self.manifest: mf.Manifest = plan.manifest
        self.id_column = plan.spec.input.id_column
        self.backlog: collections.deque[Row] = collections.deque()  # rows to hand out before reading more
        self.source_done = False
        self.known_parts = {p.name for p in self.manifest.parts}
        self.workers: list[_Worker] = []
        self.failure: str | None = None
        self.stop = stop  # SIGTERM/SIGINT/deadline (job/stop.py)
        self.stopping: str | None = None  # why the run stops early: workers commit what finished and exit
        self._stop_deadline = 0.0
        self.outcome = Outcome()
        self._unit_id = 0
        self._t0 = time.perf_counter()

    # ---- input ----------------------------------------------------------------------------------

    def _read(self, n: int) -> None:
        """Move up to n more pending rows into the backlog (rejects go to the rejects file)."""
        while n > 0 and not self.source_done:
            try:
                item = next(self.items)
            except StopIteration:
                self.source_done = True
                return
            if isinstance(item, Reject):
                self.rejects_file.write(reject_line(item) + "\n")
                self.outcome.rejects += 1
                continue
            self.backlog.append(item)
            n -= 1

    def _next_unit(self) -> list[Row]:
        if len(self.backlog) < self.dp.unit_rows:
            self._read(self.dp.unit_rows - len(self.backlog))
        return [self.backlog.popleft() for _ in range(min(self.dp.unit_rows, len(self.backlog)))]

    def _all_read(self) -> bool:
        return self.source_done and not self.backlog

    # ---- workers --------------------------------------------------------------------------------

    def start(self) -> None:
        """Fix the output schema from the first rows, then spawn the workers (one GPU each)."""
        self._read(max(self.dp.unit_rows * self.dp.workers, 256))
        self.columns = infer_types(self.columns, [r.values for r in self.backlog])
        ctx = mp.get_context("spawn")
        self.counter = counter = ctx.Value("q", mf.next_part_number(self.manifest.folder))  # kept: children unpickle it later
        job = self.plan.spec.model_dump(mode="json")
        device = self.plan.spec.engine.device
        overrides = ("engine.device=cuda",) if self.dp.gpus and device.startswith("cuda:") else ()
        threads = None if self.dp.gpus else max(1, (os.cpu_count() or 1) // self.dp.workers)
        for i in range(self.dp.workers):
            args = WorkerArgs(i, job, overrides, str(self.manifest.folder), self.manifest.fingerprint, self.columns,
                              self.engine_factory, threads)
            task_r, task_w = ctx.Pipe(duplex=False)
            rep_r, rep_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(args, task_r, rep_w, counter), name=f"{WORKER_NAME}{i}", daemon=True)
            env = {"TOKENIZERS_PARALLELISM": "false"}
            if self.dp.gpus:
                env["CUDA_VISIBLE_DEVICES"] = self.dp.gpus[i]
            with _environ(env):  # the spawned interpreter starts with this environment
                p.start()
            task_r.close()
            rep_w.close()
            self.workers.append(_Worker(i, p, task_w, rep_r))
        log.info("started %d engine workers (%s)", self.dp.workers,
                 "GPUs " + ", ".join(self.dp.gpus) if self.dp.gpus else "CPU")

    def _send(self, w: _Worker, msg: tuple) -> None:
        try:
            w.tasks.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            self._lost(w, "its pipe broke")

    def _dispatch(self) -> None:
        if self.stopping is not None:
            return
        if self.failure is not None:  # hand out nothing more; let the others commit what they hold
            for w in self.workers:
                if w.alive and w.needs_drain:
                    w.needs_drain = False
                    self._send(w, ("drain",))
            return
        for w in sorted((w for w in self.workers if w.alive), key=lambda w: len(w.outstanding)):
            while w.alive and w.unpulled < self.dp.prefetch_units:
                unit = self._next_unit()
                if not unit:
                    break
                self._unit_id += 1
                w.outstanding.update((r.id_key(self.id_column), r) for r in unit)
                w.unpulled += 1
                w.needs_drain = True
                self._send(w, ("unit", self._unit_id, unit))
        if self._all_read():
            for w in self.workers:
                if w.alive and w.needs_drain:
                    w.needs_drain = False
                    self._send(w, ("drain",))

    # ---- reports --------------------------------------------------------------------------------

    def _record(self, part: mf.PartInfo, ids: list[str]) -> None:
        """A committed part: into the manifest (once), its ids out of every worker's outstanding rows."""
        if part.name not in self.known_parts:
            self.known_parts.add(part.name)
            self.manifest.add_part(part)
            self.outcome.rows += part.rows
            self.outcome.errors += part.errors
            if self.on_commit is not None:
                self.on_commit(part)
        for w in self.workers:
            for i in ids:
                w.outstanding.pop(i, None)

    def _handle(self, w: _Worker, msg: tuple) -> None:
        kind = msg[0]
        if kind == "ready":
            w.ready, w.load_s = True, msg[1]
        elif kind == "pulled":
            w.unpulled = max(0, w.unpulled - 1)
        elif kind == "rows":
            for rec in msg[1]:
                self.outcome.prompt_tokens += rec.prompt_tokens
                self.outcome.completion_tokens += rec.completion_tokens
                if self.on_record is not None:
                    self.on_record(rec)
        elif kind == "part":
            self._record(msg[1], msg[2])
        elif kind == "exit":
            w.exited = True
        elif kind == "error":
            last = msg[1].strip().splitlines()[-1] if msg[1].strip() else "unknown error"
            log.error("engine worker %d failed:\n%s", w.index, msg[1])
            self.failure = self.failure or f"engine worker {w.index} failed: {last}"

    def _drain_reports(self, w: _Worker) -> bool:
        """Read every complete message left in a worker's pipe; False once the pipe is closed."""
        try:
            while w.reports.poll():
                self._handle(w, w.reports.recv())
        except (EOFError, OSError, ValueError, TypeError, AttributeError, ImportError) as e:
            # EOF, or the torn tail of a message from a killed worker
            if not isinstance(e, EOFError):
                log.debug("worker %d: unreadable report (%s)", w.index, e)
            return False
        return True

    def _lost(self, w: _Worker, why: str) -> None:
        """A worker is gone: record its committed parts, give its other rows to the others."""
        if not w.alive:
            return
        w.alive = False
        self._drain_reports(w)
        w.process.join(timeout=5)
        _close_pipes(w)
        if w.exited and not w.outstanding:
            return  # a clean end
        self.outcome.worker_deaths += 1
        before = {p.name for p in self.manifest.parts}
        mf.recover(self.manifest)  # parts renamed but never reported (this worker's, or a live one's not yet read)
        self.manifest.save()
        for p in self.manifest.parts:
            if p.name not in before:
                self.known_parts.add(p.name)
                self.outcome.rows += p.rows
                self.outcome.errors += p.errors
                self._record(p, part_ids(self.manifest.folder, p.name, self.id_column))
        rows = list(w.outstanding.values())
        w.outstanding.clear()
        w.unpulled = 0
        if self.stopping is not None:
            return  # stopping: its unfinished rows are done by the next run
        if self.failure is None:
            self.backlog.extendleft(reversed(rows))
        code = w.process.exitcode
        log.warning("engine worker %d died (%s, exit code %s); %d of its rows go to the other workers",
                    w.index, why, code, len(rows) if self.failure is None else 0)

    # ---- the loop -------------------------------------------------------------------------------

    def _check_stop(self) -> None:
        """A stop request: every worker commits what it finished and exits (killed after JOIN_TIMEOUT_S)."""
        if self.stopping is None and self.stop is not None and self.stop.requested() is not None:
            self.stopping = self.stop.reason
            self._stop_deadline = time.monotonic() + JOIN_TIMEOUT_S
            log.warning("stopping (%s): the engine workers commit their finished rows and exit", self.stopping)
            for w in self.workers:
                if w.alive:
                    self._send(w, ("stop_now",))

    def _done(self) -> bool:
        live = [w for w in self.workers if w.alive]
        if self.stopping is not None:
            return not live or time.monotonic() > self._stop_deadline
        if any(w.outstanding for w in live):
            return False
        if self.failure is not None:
            return True
        return self._all_read() or not live

    def run(self) -> Outcome:
        """Until every pending row is in a recorded part (or the run fails): RunError on failure,
        Stopped after a stop request (the workers' finished rows committed and recorded)."""
        if self.stop is not None:
            self.stop.in_loop = True  # a signal is seen here, between waits
        try:
            self.start()
            while True:
                self._check_stop()
                self._dispatch()
                if self._done():
                    break
                live = [w for w in self.workers if w.alive]
                ready = wait([w.reports for w in live] + [w.process.sentinel for w in live], timeout=1.0)
                for w in live:
                    if not w.alive:
                        continue
                    if w.reports in ready and not self._drain_reports(w):
                        self._lost(w, "its pipe closed")
                    elif w.process.sentinel in ready:
                        self._drain_reports(w)
                        self._lost(w, "process ended")
            self._stop_all()
        finally:
            if self.stop is not None:
                self.stop.in_loop = False
            self._kill_all()
            self._remove_dead_temps()
        self.outcome.load_seconds = max((w.load_s for w in self.workers), default=0.0)
        if self.stopping is not None:
            raise Stopped(self.stopping)
        if self.failure is not None:
            raise RunError(f"{self.failure}; run again to resume")
        if not self._all_read():
            raise RunError(f"all {len(self.workers)} engine workers died; run again to resume")
        return self.outcome

    def _stop_all(self) -> None:
        for w in self.workers:
            if w.alive:
                self._send(w, ("stop",))
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for w in self.workers:
            if w.alive:
                while self._drain_reports(w) and not w.exited and time.monotonic() < deadline:
                    wait([w.reports, w.process.sentinel], timeout=0.5)
                    if not w.process.is_alive():
                        self._drain_reports(w)
                        break
                w.process.join(timeout=max(0.0, deadline - time.monotonic()))

    def _remove_dead_temps(self) -> None:
        """Every worker has ended: a temp part left now is one a killed worker never finished."""
        for p in layout.tmp_dir(self.manifest.folder).files():
            if p.name.startswith(".part-"):
                try:
                    p.delete()
                except OSError:
                    pass

    def _kill_all(self) -> None:
        for w in self.workers:
            if w.process.is_alive():
                w.process.kill()
                w.process.join(timeout=5)
            _close_pipes(w)


class _environ:
    """Set environment variables for the span of a `with` block (a spawned child copies them)."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for k, v in self.values.items():
            self.saved[k] = os.environ.get(k)
            os.environ[k] = v

    def __exit__(self, *exc: Any) -> None:
        for k, old in self.saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


class DataParallelExecutor:
    """The data-parallel executor: `dp.workers` engine processes fed by a Coordinator in this process.

    hooks.on_step is not called: engine steps happen in the workers. hooks.engine_factory must be
    importable by name (it is sent to the spawned workers).
    """

    name: ClassVar[str] = "data_parallel"

    def __init__(self, dp: DataParallelPlan) -> None:
        self.dp = dp

    @classmethod
    def for_job(cls, spec: JobSpec) -> "DataParallelExecutor":
        return cls(plan_data_parallel(spec))

    def prepare(self, plan: JobPlan, hooks: RunHooks) -> None:
        """Nothing: the engines start in their own processes, in run()."""

    def run(self, plan: JobPlan, hooks: RunHooks) -> RunSummary:
        spec = plan.spec
        columns = output_columns(plan)
        needed = read_columns(spec, template_columns(plan))
        stats = Progress()
        bar = ProgressDisplay(plan.pending_count, stats, hooks.progress)

        def on_record(rec: Any) -> None:
            stats.add(rec)
            bar.update()
            if hooks.on_row is not None:
                hooks.on_row(rec)
            if hooks.on_progress is not None:
                hooks.on_progress(stats)

        stopped = None
        coord = None
        try:
            with rejects_file(plan.output_dir) as rf:
                coord = Coordinator(plan, self.dp, columns, pending_rows(plan, needed), rf, hooks.engine_factory, on_record,
                                    hooks.on_commit, hooks.stop)
                outcome = coord.run()
        except Stopped as e:  # the workers' finished rows are committed and recorded
            if coord is None:
                raise
            stopped, outcome = e.reason, coord.outcome
        finally:
            bar.close()
        # rows of a dead worker that were finished but not committed were done again: count committed rows
        stats.rows, stats.errors, stats.rejects = outcome.rows, outcome.errors, outcome.rejects
        stats.prompt_tokens, stats.completion_tokens = outcome.prompt_tokens, outcome.completion_tokens
        elapsed = time.perf_counter() - hooks.started
        return summarize(plan, outcome.rejects, stats, max(0.0, elapsed - outcome.load_seconds),
                         load_seconds=outcome.load_seconds, stopped=stopped)


def _close_pipes(w: Any) -> None:
    """Close a worker's task and report pipes (either may already be closed)."""
    for conn in (w.tasks, w.reports):
        try:
            conn.close()
        except OSError:
            pass
