"""What the measured run did besides its steps' times: a torch profile of a window of its steps, the
Triton kernels it compiled, the CUDA graph sizes it captured on first use (bench/throughput.py reports
them)."""

from __future__ import annotations

from pathlib import Path

import torch

PROFILE_ENV = "BATCHINFER_PROFILE_DIR"  # a folder: profile a window of steps into it
PROFILE_START_ENV = "BATCHINFER_PROFILE_START"  # steps of the measured run before the window
PROFILE_STEPS_ENV = "BATCHINFER_PROFILE_STEPS"  # steps in the window (default 5)
# with it, the window opens at the first decode-only step of at least this many rows after those steps
PROFILE_DECODE_ENV = "BATCHINFER_PROFILE_DECODE_ROWS"


class StepWindowProfiler:
    """A torch profiler over `num_steps` engine steps after `start_step` steps of the measured run.

    Writes a chrome trace and two text tables (top ops by CUDA time and by CPU time) to `out_dir`
    and prints the CUDA table's head: where a step's time goes, on the device and on the host.
    """

    def __init__(self, out_dir: Path, start_step: int = 60, num_steps: int = 5, decode_rows: int | None = None) -> None:
        """decode_rows: open the window at the first step from start_step on that is decode-only with
        at least this many rows (a decode stretch's steps, not the mixed steps before it)."""
        self.out_dir, self.start_step, self.num_steps = out_dir, start_step, num_steps
        self.decode_rows = decode_rows
        self.seen = 0
        self.opened_at = 0  # the step after which the window opened
        self.prof: torch.profiler.profile | None = None
        self.done = False

    def _opens(self, stats) -> bool:
        if self.decode_rows is None:
            return self.seen == self.start_step
        return (self.seen >= self.start_step and stats.num_prefill_tokens == 0
                and stats.num_decode_tokens >= self.decode_rows)

    def on_step(self, stats) -> None:
        self.seen += 1
        if self.done:
            return
        if self.prof is None and self._opens(stats):
            self.opened_at = self.seen
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=acts, record_shapes=False)
            self.prof.start()
        elif self.prof is not None and self.seen >= self.opened_at + self.num_steps:
            self.finish()

    def finish(self) -> None:
        if self.prof is None or self.done:
            return
        self.done = True
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.stop()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prof.export_chrome_trace(str(self.out_dir / "trace.json"))
        avg = self.prof.key_averages()
        tables = {}
        for key in ("cuda_time_total", "cpu_time_total", "self_cpu_time_total"):
            try:
                tables[key] = avg.table(sort_by=key, row_limit=30)
            except Exception as exc:  # no CUDA activity on a CPU run
                tables[key] = f"({key}: {exc})"
            (self.out_dir / f"top-{key}.txt").write_text(tables[key] + "\n", encoding="utf-8")
        print(f"profile of {self.num_steps} steps after step {self.opened_at}:")
        print(tables["cuda_time_total"])
        print(tables["self_cpu_time_total"])


def jit_snapshot() -> dict | None:
    """Triton kernels compiled so far, by kernel (None without Triton)."""
    try:
        from batchinfer.kernels.jit_stats import compiled_variants

        return compiled_variants()
    except ImportError:  # no triton (CPU-only install)
        return None


def graphs_captured_on_use(runner) -> int:
    """How many CUDA graph sizes (decode, mixed, verify) the runner has captured on first use, mid-run
    (engine/cuda_graphs.py; each costs a capture, ~25-70 ms on an H100/H200 host, in the step that meets it)."""
    return sum(len(g.captured_on_use) for g in (runner.graphs, runner.mixed_graphs, runner.verify_graphs) if g is not None)


def jit_compiled_since(before: dict | None) -> dict | None:
    """Kernels compiled since `before` (jit_snapshot), by kernel."""
    if before is None:
        return None
    from batchinfer.kernels.jit_stats import compiled_since

    return compiled_since(before)
