"""Part files committed on a background thread, so the engine's loop never waits for Parquet or fsync.

`BackgroundPartWriter` buffers rows and decides when a part is due exactly as PartWriter does; a due
part's rows go into a bounded queue and one writer thread commits them, in order, with PartWriter's
protocol (temp name, fsync, rename, manifest): parts are numbered and recorded in the order their
rows were added, and each is complete or absent, so a kill at any moment resumes exactly once (rows
still in the queue were never committed: a resume does them again). At most `max_queued` parts wait
for the thread; a disk slower than the engine then slows the engine instead of filling memory.

`on_commit` callbacks run on the caller's thread (at its next add/flush/close), not on the writer
thread, so they may touch what the caller's thread owns (the run's observer). A failed commit is
raised on the caller's thread at its next call; the writer commits nothing after it.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable

import pyarrow as pa

from batchinfer.io.manifest import Manifest, PartInfo
from batchinfer.io.writer import PartWriter

log = logging.getLogger(__name__)

_STOP = object()


class BackgroundPartWriter(PartWriter):
    """A PartWriter whose commits run on one background thread (see the module docstring)."""

    def __init__(
        self,
        manifest: Manifest,
        columns: dict[str, pa.DataType | None],
        rows_per_part: int,
        seconds_per_part: float,
        on_commit: Callable[[PartInfo], None] | None = None,
        max_queued: int = 2,
    ) -> None:
        super().__init__(manifest, columns, rows_per_part, seconds_per_part, on_commit)
        self._parts: "queue.Queue[Any]" = queue.Queue(maxsize=max_queued)
        self._committed: "queue.Queue[PartInfo]" = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._work, name="part-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while True:
            rows = self._parts.get()
            if rows is _STOP:
                return
            if self._error is not None:
                continue  # after a failure: commit nothing more (a later part must not skip a lost one)
            try:
                self._committed.put(self.commit(rows))
            except BaseException as e:
                self._error = e

    def _deliver(self) -> None:
        """Run on_commit for parts committed since the last call; raise the writer thread's failure."""
        while True:
            try:
                part = self._committed.get_nowait()
            except queue.Empty:
                break
            if self.on_commit is not None:
                self.on_commit(part)
        if self._error is not None:
            self.broken = True
            raise self._error

    def add(self, row: dict[str, Any]) -> None:
        self._deliver()
        super().add(row)

    def flush(self) -> None:
        """Hand the buffered rows to the writer thread as one part (blocks while max_queued parts wait)."""
        self._deliver()
        if not self._buffer:
            return
        rows, self._buffer, self._started = self._buffer, [], None
        self._parts.put(rows)

    def _drain(self) -> None:
        """Wait until every handed-over part is committed (or the thread failed), then stop it."""
        if self._thread.is_alive():
            self._parts.put(_STOP)
            self._thread.join()

    def close(self) -> None:
        """Commit what is buffered and queued, wait for it, run the callbacks; raise a commit's failure."""
        try:
            self.flush()
        finally:
            self._drain()
        self._deliver()

    def save_finished(self) -> None:
        """After a failure elsewhere: commit the rows that did finish (best effort), so a resume skips them."""
        try:
            self.close()
        except Exception as e:  # the original failure matters more
            log.warning("could not save the finished rows: %s", e)
