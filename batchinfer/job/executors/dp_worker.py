"""One data-parallel engine process: load the engine, take work units from the coordinator, commit parts.

The process is started with the spawn method and CUDA_VISIBLE_DEVICES already set to its one GPU (by
the driver, before the interpreter starts, so torch sees only that GPU). It speaks to the driver over
two one-way pipes:

driver -> worker (`tasks`): ("unit", unit_id, [Row, ...]) | ("drain",) | ("stop",) | ("stop_now",)
worker -> driver (`reports`): ("ready", load_seconds) | ("pulled", unit_id) | ("rows", [RowRecord, ...])
    | ("part", PartInfo, [id, ...]) | ("exit",) | ("error", traceback_text)

Units flow into one lazy request stream for the engine (no batch drains at unit edges); "drain" ends
that stream, so the engine finishes what it holds and the writer commits its last part; more units
after a drain start a new stream. A reader thread empties `tasks` at once (the driver never blocks on
a full pipe); when the driver is gone (EOF) the worker exits at once: the driver's output-folder lock
is released then, and a worker still writing parts would race the next run.

"stop_now" (the driver got SIGTERM/SIGINT or hit its deadline): take no more rows, drop the
unfinished ones, commit and report the finished ones, exit. A worker ignores SIGINT (a Ctrl-C in the
terminal reaches the whole process group: the driver decides) and takes SIGTERM as "stop_now".
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from batchinfer.job.executors.parts import WorkerPartWriter
from batchinfer.job.spec import JobSpec, load_job
from batchinfer.job.stage import RowStages, execute, row_stages
from batchinfer.job.stop import Stopped
from batchinfer.job.summary import Progress

EXIT_ORPHANED = 3  # the driver went away


@dataclass(frozen=True)
class WorkerArgs:
    """Everything a worker needs, picklable (the job travels as JSON and is validated again)."""

    index: int
    job: dict[str, Any]  # JobSpec.model_dump(mode="json"); its paths are absolute
    overrides: tuple[str, ...]  # e.g. engine.device=cuda when the driver's device named a GPU index
    folder: str  # the output folder: a local path or a URI
    fingerprint: str
    columns: dict[str, Any]  # output column -> Arrow type (fixed by the driver: every worker writes the same schema)
    engine_factory: Callable[..., Any]  # engine_factory(spec) -> engine; must be importable (spawn)
    threads: int | None = None  # torch CPU threads (CPU workers share the host's cores)
    report_every_s: float = 0.2  # finished-row records are sent at least this often


class _Outbox:
    """Finished-row records, sent to the driver in small batches (progress bars, on_row hooks)."""

    def __init__(self, reports: Any, every_s: float) -> None:
        self.reports = reports
        self.every_s = every_s
        self.records: list[Any] = []
        self.last = time.monotonic()

    def add(self, record: Any) -> None:
        self.records.append(record)
        if len(self.records) >= 64 or time.monotonic() - self.last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        if self.records:
            self.reports.send(("rows", self.records))
        self.records = []
        self.last = time.monotonic()


class _LockedSender:
    """The `reports` pipe, safe to send on from two threads (stage 3's feeder sends "pulled")."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.lock = threading.Lock()

    def send(self, msg: Any) -> None:
        with self.lock:
            self.conn.send(msg)


def _start_reader(tasks: Any, stop_now: threading.Event) -> "queue.Queue[tuple]":
    inbox: "queue.Queue[tuple]" = queue.Queue()

    def read() -> None:
        while True:
            try:
                msg = tasks.recv()
            except (EOFError, OSError):
                os._exit(EXIT_ORPHANED)
            if msg[0] == "stop_now":
                stop_now.set()
                msg = ("stop",)
            inbox.put(msg)
            if msg[0] == "stop":
                return

    threading.Thread(target=read, name="batchinfer-tasks", daemon=True).start()
    return inbox


def worker_main(args: WorkerArgs, tasks: Any, reports: Any, counter: Any) -> None:
    """Process entry point: serve work units until "stop"; any exception is reported, then exit 1."""
    stop_now = threading.Event()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: stop_now.set())
    try:
        _serve(args, tasks, reports, counter, stop_now)
    except Stopped:
        reports.send(("exit",))
    except BaseException:
        try:
            reports.send(("error", traceback.format_exc()))
        except Exception:
            pass
        sys.exit(1)


def _serve(args: WorkerArgs, tasks: Any, reports: Any, counter: Any, stop_now: threading.Event) -> None:
    reports = _LockedSender(reports)
    spec = load_job(args.job, args.overrides)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    engine = args.engine_factory(spec)
    reports.send(("ready", time.perf_counter() - t0))
    stages = row_stages(spec, engine)

    def next_number() -> int:
        with counter.get_lock():
            n = counter.value
            counter.value += 1
        return n

    inbox = _start_reader(tasks, stop_now)

    def check() -> None:
        if stop_now.is_set():
            raise Stopped("the driver asked to stop")

    while True:
        msg = inbox.get()
        if msg[0] == "stop":
            break
        if msg[0] == "drain":
            continue
        if _session(msg, inbox, args, spec, engine, stages, reports, next_number, check) == "stop":
            break
    reports.send(("exit",))


def _session(first: tuple, inbox: "queue.Queue[tuple]", args: WorkerArgs, spec: JobSpec, engine: Any, stages: RowStages,
             reports: Any, next_number: Callable[[], int], check: Callable[[], None]) -> str:
    """One request stream over units until "drain" (or "stop"); its rows all end in committed parts."""
    outbox = _Outbox(reports, args.report_every_s)
    ended = ["drain"]

    def on_part(part: Any, ids: list[str]) -> None:
        outbox.flush()  # rows before the part that holds them
        reports.send(("part", part, ids))

    writer = WorkerPartWriter(
        args.folder, args.fingerprint, spec.input.id_column, args.columns,
        spec.output.rows_per_part, spec.output.seconds_per_part, next_number, on_part,
    )

    def rows() -> Iterator[Any]:
        msg = first
        while msg[0] == "unit":
            reports.send(("pulled", msg[1]))
            yield from msg[2]
            msg = inbox.get()
        ended[0] = msg[0]

    try:
        execute(rows(), engine, stages, writer, None, Progress(), on_row=outbox.add, should_stop=check)
    except BaseException:
        writer.save_finished()  # the driver records what did finish; the rest is done on resume
        outbox.flush()
        raise
    writer.close()
    outbox.flush()
    return ended[0]
