"""Stopping a run early: the request (a signal's, or a deadline's) that every executor checks.

A StopRequest is made by the driver (driver.py installs the SIGINT/SIGTERM handlers that set it) and
handed to the executor in its RunHooks. Inside the engine loop it is seen between engine steps, rows
and requests (`check` raises Stopped there): no new rows are admitted, the unfinished ones are
dropped (the next run does them), the finished ones are committed, and the executor returns its
summary with `stopped` set. Outside the loop (planning, loading the model) there is nothing to
commit, so a signal raises Stopped at once.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from batchinfer.job.spec import JobError

EXIT_STOPPED = 75  # EX_TEMPFAIL: the run stopped early with its finished rows committed; run it again


class Stopped(BaseException):
    """A stop request (SIGINT, SIGTERM or the stop_after deadline) reached the run.

    A BaseException, like KeyboardInterrupt: no `except Exception` on the way may swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class StopRequest:
    """Whether (and why) the run should stop early: a signal set `reason`, or `deadline` passed."""

    def __init__(self, stop_after_s: float | None = None) -> None:
        self.stop_after_s = stop_after_s
        self.deadline = time.monotonic() + stop_after_s if stop_after_s else None
        self.reason: str | None = None
        self.in_loop = False  # True while an engine loop runs (a signal then only sets reason)
        self._raised = False

    def requested(self) -> str | None:
        """The reason to stop, once there is one (a signal, or the deadline has passed)."""
        if self.reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.reason = f"the stop_after deadline ({self.stop_after_s:g}s) passed"
        return self.reason

    def check(self, *_: Any) -> None:
        """Raise Stopped (once) when a stop was requested; called between steps, rows and requests."""
        if not self._raised and self.requested() is not None:
            self._raised = True
            raise Stopped(self.reason)  # type: ignore[arg-type]

    def request(self, reason: str) -> None:
        """A stop is asked for (by a signal): inside the loop it is seen at the next check, else raised now."""
        self.reason = reason
        if not self.in_loop:
            self._raised = True
            raise Stopped(reason)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)?")
_UNIT = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, None: 1.0}


def parse_duration(text: "str | float | int | None") -> float | None:
    """Seconds in '90m', '2h', '1h30m', '3600s', '3600' (or a number of seconds); None stays None."""
    if text is None or isinstance(text, (int, float)):
        if text is not None and (not math.isfinite(text) or text <= 0):
            raise JobError(f"--stop-after {text!r}: give a positive duration such as 90m, 2h or 3600s")
        return None if text is None else float(text)
    t = str(text).strip().lower().replace(" ", "")
    pos, total = 0, 0.0
    while pos < len(t):
        m = _DURATION.match(t, pos)
        if m is None:
            break
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    if not t or pos != len(t) or total <= 0:
        raise JobError(f"--stop-after {text!r}: give a positive duration such as 90m, 2h, 1h30m or 3600s")
    return total
