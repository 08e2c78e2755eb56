"""`--trace DIR`: a torch profiler trace of a few engine steps, driven by the step callback.

The profiler starts after step `start_step` has been reported (so warm-up, compilation and CUDA-graph
capture are behind us) and stops after `num_steps` more steps; the chrome trace (open it in
chrome://tracing or https://ui.perfetto.dev) and a text table of the top ops are written to DIR.
Profiling only a window keeps the trace small and the run's own speed unharmed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from batchinfer.engine.stats import StepStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceConfig:
    """Where the trace goes and which steps it covers: the start_step+1-th .. start_step+num_steps-th
    step reported (counted from 1 by the tracer, whatever numbering the engine uses)."""

    trace_dir: Path
    start_step: int = 5
    num_steps: int = 3
    record_shapes: bool = True
    with_stack: bool = False

    def __post_init__(self) -> None:
        if self.start_step < 0:
            raise ValueError(f"trace start_step must be >= 0, not {self.start_step}")
        if self.num_steps < 1:
            raise ValueError(f"trace num_steps must be at least 1, not {self.num_steps}")


class StepTracer:
    """Counts reported steps; profiles the window of steps the config names; exports once."""

    def __init__(self, config: TraceConfig) -> None:
        self.config = config
        self._seen = 0
        self._profiler: torch.profiler.profile | None = None
        self._profiled = 0
        self.trace_path: Path | None = None
        if config.start_step == 0:
            self._start()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities, record_shapes=self.config.record_shapes, with_stack=self.config.with_stack
        )
        self._profiler.start()
        log.info("profiler started after step %d", self._seen)

    def on_step(self, stats: StepStats) -> None:
        self._seen += 1
        if self._profiler is None:
            if self.trace_path is None and self._seen == self.config.start_step:
                self._start()
            return
        self._profiler.step()
        self._profiled += 1
        if self._profiled >= self.config.num_steps:
            self._finish()

    def _finish(self) -> None:
        prof = self._profiler
        if prof is None:
            return
        self._profiler = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
        out = self.config.trace_dir
        out.mkdir(parents=True, exist_ok=True)
        first = self.config.start_step + 1
        last = self.config.start_step + self._profiled
        path = out / f"trace-steps-{first}-{last}.json"
        prof.export_chrome_trace(str(path))
        sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        (out / f"trace-steps-{first}-{last}.txt").write_text(table + "\n", encoding="utf-8")
        self.trace_path = path
        log.info("wrote profiler trace of %d steps to %s", self._profiled, path)

    def close(self) -> Path | None:
        """Export a window the run ended inside of (fewer steps than asked); returns the trace path."""
        if self._profiler is not None:
            self._finish()
        elif self.trace_path is None:
            log.warning("no trace written: the run had %d steps, the trace starts after step %d",
                        self._seen, self.config.start_step)
        return self.trace_path
