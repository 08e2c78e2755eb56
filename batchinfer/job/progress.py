"""What people see of a running job: a bar on a terminal, a log line every N seconds anywhere else.

On a terminal (stderr is a TTY) the bar moves once per finished row and shows output tokens per
second and errors. Under cron, Airflow or CI (stderr is a pipe or a file) a bar would be noise, so
instead a plain line goes to the `batchinfer.progress` logger every `interval_s` seconds (and one at
the end): rows done / total, rows/s, output tok/s, ETA, errors. With `--log-format json` those lines
are JSON objects (observe/logs.py) carrying the same numbers as fields.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

from batchinfer.job.summary import Progress

log = logging.getLogger("batchinfer.progress")


@dataclass(frozen=True)
class ProgressOptions:
    """show: a bar (terminal) or log lines (elsewhere); off: neither. interval_s: seconds between log lines."""

    show: bool = False
    interval_s: float = 30.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0:
            raise ValueError(f"the progress interval must be above 0 seconds, not {self.interval_s}")


def progress_fields(stats: Progress, total: int, now: float | None = None) -> dict[str, Any]:
    """The numbers of a progress line: rows done / total, rates since the engine started, ETA, errors."""
    now = time.perf_counter() if now is None else now
    elapsed = max(now - stats.started, 1e-9)
    rows_s = stats.rows / elapsed
    left = max(total - stats.rows, 0)
    return {
        "event": "progress",
        "rows_done": stats.rows,
        "rows_total": total,
        "rows_per_s": round(rows_s, 3),
        "output_tokens_per_s": round(stats.completion_tokens / elapsed, 1),
        "eta_s": round(left / rows_s, 1) if rows_s > 0 else None,
        "errors": stats.errors + stats.rejects,
        "elapsed_s": round(elapsed, 3),
    }


def _duration(s: float | None) -> str:
    if s is None:
        return "?"
    s = int(round(s))
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{(s % 3600) // 60:02d}m"


def progress_text(f: dict[str, Any]) -> str:
    """One human line of progress_fields."""
    total = f["rows_total"]
    pct = f" ({100 * f['rows_done'] / total:.1f}%)" if total else ""
    return (
        f"progress: {f['rows_done']:,}/{total:,} rows{pct}, {f['rows_per_s']:,.1f} rows/s, "
        f"{f['output_tokens_per_s']:,.0f} output tok/s, ETA {_duration(f['eta_s'])}, {f['errors']:,} errors"
    )


class ProgressDisplay:
    """The bar (terminal) or the periodic log lines (elsewhere) of one run; update() after each finished row."""

    def __init__(self, total: int, stats: Progress, options: ProgressOptions | None = None, stream: TextIO | None = None) -> None:
        self.total, self.stats = total, stats
        self.options = options or ProgressOptions()
        stream = stream if stream is not None else sys.stderr
        tty = bool(getattr(stream, "isatty", lambda: False)())
        self.mode = "off" if not self.options.show else ("bar" if tty else "log")
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="row", dynamic_ncols=True, file=stream, smoothing=0.1)
        elif self.mode == "log":
            self._thread = threading.Thread(target=self._every_interval, name="progress-log", daemon=True)
            self._thread.start()

    def update(self) -> None:
        """One more row finished (already counted in stats)."""
        if self._bar is None:
            return
        elapsed = time.perf_counter() - self.stats.started
        self._bar.set_postfix_str(
            f"{self.stats.completion_tokens / elapsed if elapsed > 0 else 0:,.0f} out tok/s, "
            f"{self.stats.errors + self.stats.rejects} errors", refresh=False,
        )
        self._bar.update(1)

    def line(self) -> None:
        """Log one progress line now."""
        f = progress_fields(self.stats, self.total)
        log.info("%s", progress_text(f), extra={"fields": f})

    def _every_interval(self) -> None:
        while not self._stop.wait(self.options.interval_s):
            self.line()

    def close(self) -> None:
        """Stop the bar or the log lines (log mode: one last line with the final numbers)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.line()
