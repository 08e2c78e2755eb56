"""Stage 3 ahead of the engine: rows are rendered and tokenised in batches on a thread pool, in order.

The engine's thread only takes finished batches. A feeder thread reads the input (the readers mostly
release the GIL) and cuts it into batches, each batch is prepared by one call on the pool (the fast
tokenizer's batch call releases the GIL and spreads over the cores), and the results come out in
input order. At most `max_batches` batches are submitted and not yet taken by the consumer, so a
tokenizer far faster than the engine never holds more than that many batches in memory.

Batch sizes ramp up from `first_rows` to `batch_rows` (doubling), so the first rows reach the engine
quickly and later batches amortise the call overhead.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Iterator, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class PrefetchConfig:
    """How far and how wide stage 3 runs ahead: batch sizes, batches in flight, pool threads."""

    batch_rows: int = 64
    first_rows: int = 8
    max_batches: int = 8
    workers: int = 2

    def __post_init__(self) -> None:
        if self.batch_rows < 1 or self.first_rows < 1 or self.max_batches < 1 or self.workers < 1:
            raise ValueError("prefetch sizes must be at least 1")


_END = object()


@dataclass(frozen=True)
class _Failed:
    error: BaseException


class Prefetch(Generic[T, R]):
    """Iterate `prepare(batch)` results, flattened and in order, computed ahead on a thread pool.

    prepare(list of items) -> list of results (any length; usually one per item). Exceptions from
    reading `items` or from `prepare` are raised in the consumer, in order (what came before them is
    yielded first). close() (or leaving a `with` block) stops the feeder and waits for its threads.
    """

    def __init__(self, items: Iterable[T], prepare: Callable[[list[T]], list[R]], config: PrefetchConfig | None = None,
                 name: str = "prefetch") -> None:
        self.config = config or PrefetchConfig()
        self._items = items
        self._prepare = prepare
        self._slots = threading.Semaphore(self.config.max_batches)
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.in_flight = 0  # batches submitted and not yet taken by the consumer
        self.max_in_flight = 0  # the most there ever were (tests check the bound)
        self._pool = ThreadPoolExecutor(self.config.workers, thread_name_prefix=f"{name}-pool")
        self._feeder = threading.Thread(target=self._feed, name=f"{name}-feeder", daemon=True)
        self._feeder.start()

    # ---- feeder thread -------------------------------------------------------------------------

    def _take_slot(self) -> bool:
        while not self._stop.is_set():
            if self._slots.acquire(timeout=0.05):
                return True
        return False

    def _feed(self) -> None:
        size = min(self.config.first_rows, self.config.batch_rows)
        batch: list[T] = []
        try:
            for item in self._items:
                batch.append(item)
                if len(batch) >= size:
                    if not self._submit(batch):
                        return
                    batch, size = [], min(2 * size, self.config.batch_rows)
                if self._stop.is_set():
                    return
        except BaseException as e:  # a reader error: the consumer raises it after the rows before it
            if not batch or self._submit(batch):
                self._queue.put(_Failed(e))
            return
        if batch and not self._submit(batch):
            return
        self._queue.put(_END)

    def _submit(self, batch: list[T]) -> bool:
        if not self._take_slot():
            return False
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._queue.put(self._pool.submit(self._prepare, batch))
        return True

    # ---- consumer ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[R]:
        while True:
            got = self._queue.get()
            if got is _END:
                return
            if isinstance(got, _Failed):
                raise got.error
            fut: Future = got
            try:
                results = fut.result()
            finally:
                with self._lock:
                    self.in_flight -= 1
                self._slots.release()
            yield from results

    def close(self) -> None:
        """Stop reading ahead; wait for the feeder and the pool (results not taken are dropped)."""
        self._stop.set()
        self._feeder.join(timeout=10.0)  # it stops at its next item (a source blocked on its own input may not return)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "Prefetch[T, R]":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
