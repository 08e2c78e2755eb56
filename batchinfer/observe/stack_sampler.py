"""Where every thread of this process spends its wall clock: its Python stacks sampled on a timer.

A debugging aid for start-up, where threads (the preflight's, the GPU runtime's, the engine's main
thread) share one GIL and a phase's length says nothing about why. Set `BATCHINFER_SAMPLE_STACKS` to
a file path: `batchinfer run` then samples for `BATCHINFER_SAMPLE_STACKS_SECONDS` (default 15) and
writes one line per (thread, stack) with its sample count, most frequent first, the stack outermost
frame first (`file:function:line;...`), plus each thread's total, then the main thread's timeline:
for each `bucket` of time since the sampler started, its most frequent innermost frames. A sample is taken when the sampler
gets the GIL, so a thread's samples are where it was each time Python code could run: inside C code
that keeps the GIL (a Rust tokenizer build, say), the others show at the line they wait on.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from pathlib import Path

ENV_PATH = "BATCHINFER_SAMPLE_STACKS"
ENV_SECONDS = "BATCHINFER_SAMPLE_STACKS_SECONDS"


def _stack(frame, depth: int) -> str:
    names: list[str] = []
    while frame is not None and len(names) < depth:
        code = frame.f_code
        names.append(f"{Path(code.co_filename).name}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return ";".join(reversed(names))


class StackSampler:
    """Samples every thread's stack each `interval` seconds for `seconds`, then writes `path`."""

    def __init__(
        self, path: Path, seconds: float = 15.0, interval: float = 0.005, depth: int = 40, bucket: float = 0.1,
    ) -> None:
        self.path, self.seconds, self.interval, self.depth, self.bucket = Path(path), seconds, interval, depth, bucket
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.samples = 0
        self.started = time.perf_counter()
        self.main: list[tuple[float, str]] = []  # (seconds since started, stack) of the main thread
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self) -> "StackSampler":
        self._thread.start()
        return self

    def join(self) -> None:
        self._thread.join()

    def sample(self) -> None:
        """Count every thread's current stack once (this sampler's own thread left out)."""
        names = {t.ident: t.name for t in threading.enumerate()}
        me = threading.get_ident()
        main = threading.main_thread().ident
        now = time.perf_counter() - self.started
        for ident, frame in sys._current_frames().items():
            if ident != me:
                stack = _stack(frame, self.depth)
                self.counts[(names.get(ident, str(ident)), stack)] += 1
                if ident == main:
                    self.main.append((now, stack))
        self.samples += 1

    def _run(self) -> None:
        self.started = time.perf_counter()
        end = self.started + self.seconds
        while time.perf_counter() < end:
            self.sample()
            time.sleep(self.interval)
        self.write()

    def write(self) -> None:
        per_thread: collections.Counter[str] = collections.Counter()
        for (thread, _), n in self.counts.items():
            per_thread[thread] += n
        lines = [f"# {self.samples} samples every {self.interval * 1000:.0f} ms over {self.seconds:g} s"]
        lines += [f"# thread {t}: {n}" for t, n in per_thread.most_common()]
        lines += [f"{n} {t} {stack}" for (t, stack), n in self.counts.most_common()]
        lines += ["# main thread timeline: bucket start (s), samples, its most frequent innermost frames"]
        buckets: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for at, stack in self.main:
            buckets[int(at / self.bucket)][";".join(stack.split(";")[-3:])] += 1
        for b in sorted(buckets):
            top, n = buckets[b].most_common(1)[0]
            lines.append(f"@{b * self.bucket:.2f} {sum(buckets[b].values())} {n}x {top}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("\n".join(lines) + "\n")


def start_from_env(environ: dict[str, str] | None = None) -> StackSampler | None:
    """A started sampler when BATCHINFER_SAMPLE_STACKS names a file, else None."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_PATH)
    if not path:
        return None
    return StackSampler(Path(path), float(env.get(ENV_SECONDS, "15"))).start()
