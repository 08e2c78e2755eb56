"""Where a run's wall clock goes: named spans (start, end) recorded by the run itself, on one clock.

The driver, the preflight threads, the engine's start-up and the report writer each record their
spans here; the summary and `_report.json` carry them (`RunSummary.phases`), `bench job` prints them
as the start-up / teardown breakdown. Times are seconds since the process started (psutil), so
spans of threads that overlap (the input scan while the model loads) show as overlapping.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator


def process_start_perf() -> float:
    """The process's start on the perf_counter clock (its creation time per the OS; now if unknown)."""
    now_wall, now_perf = time.time(), time.perf_counter()
    try:
        import psutil

        created = psutil.Process().create_time()
    except Exception:  # no psutil, or a platform without it: count from now
        return now_perf
    return now_perf - max(0.0, now_wall - created)


@dataclass(frozen=True)
class Span:
    """One phase: its name, start and end (perf_counter seconds) and the thread that ran it."""

    name: str
    start: float
    end: float
    thread: str


class PhaseTimer:
    """Records spans and instants of one run (thread-safe). origin: the perf_counter time of 0 s."""

    def __init__(self, origin: float | None = None) -> None:
        self.origin = process_start_perf() if origin is None else origin
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._marks: dict[str, float] = {}

    def add(self, name: str, start: float, end: float, thread: str | None = None) -> None:
        """A span measured elsewhere (perf_counter start and end)."""
        with self._lock:
            self._spans.append(Span(name, start, end, thread or threading.current_thread().name))

    @contextmanager
    def span(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (recorded also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter())

    def mark(self, name: str, at: float | None = None, first: bool = False) -> None:
        """An instant (perf_counter; now by default). first: keep an earlier mark of that name."""
        with self._lock:
            if first and name in self._marks:
                return
            self._marks[name] = time.perf_counter() if at is None else at

    def has_mark(self, name: str) -> bool:
        return name in self._marks

    def as_dict(self) -> dict[str, Any]:
        """{"origin_unix", "spans": [{name, start_s, end_s, s, thread}], "marks": {name: s}}: seconds since the
        process started (origin_unix + a time = its wall-clock time, to line them up with another clock)."""
        o = self.origin
        with self._lock:
            spans = sorted(self._spans, key=lambda s: s.start)
            marks = dict(self._marks)
        return {
            "clock": "seconds since the process started",
            "origin_unix": time.time() - (time.perf_counter() - o),  # the wall-clock time of 0 s
            "spans": [
                {"name": s.name, "start_s": round(s.start - o, 4), "end_s": round(s.end - o, 4),
                 "s": round(s.end - s.start, 4), "thread": s.thread}
                for s in spans
            ],
            "marks": {k: round(v - o, 4) for k, v in sorted(marks.items(), key=lambda kv: kv[1])},
        }


def add_spans(timer: PhaseTimer | None, spans: Any, prefix: str = "") -> None:
    """Copy (name, start, end) tuples recorded by another part (e.g. the engine's start-up) into timer."""
    if timer is None:
        return
    for name, start, end in spans or ():
        timer.add(prefix + name, start, end)
