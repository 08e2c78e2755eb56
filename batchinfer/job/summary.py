"""What a run reports: one RowRecord per finished row, the running Progress counters, the RunSummary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchinfer.engine.request import Result
from batchinfer.io import layout

if TYPE_CHECKING:
    from batchinfer.job.plan import JobPlan


@dataclass(frozen=True)
class RowRecord:
    """Per-row timing record (for metrics): what happened to one row in the engine."""

    row_id: Any  # the id's canonical key (io/id_key.py)
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    times: Any = None  # engine RequestTimes, or None for rows that never reached the engine
    num_preemptions: int = 0
    error: str | None = None  # the output row's error (also set when the answer failed validation)
    result: Result | None = None  # the engine's Result, None for rows that never reached it
    excerpt: str | None = None  # the start of the row's input (RowMeta.excerpt), for the run report


@dataclass
class Progress:
    """Counters of the running job; `on_progress` callbacks see this after every finished row."""

    rows: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    rejects: int = 0
    started: float = field(default_factory=time.perf_counter)

    def add(self, record: RowRecord) -> None:
        """Count one finished row."""
        self.rows += 1
        self.errors += record.error is not None
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens


@dataclass(frozen=True)
class RunSummary:
    """What a run did. Totals cover the whole job's output folder (all runs), `this_run_*` this run."""

    output_path: str
    input_rows: int  # rows with an id, over all input files
    rows_done: int  # rows of the current input files committed in the output (all runs)
    error_rows: int  # of those, rows with an error (all runs)
    rejects: int  # input lines with no usable id (see _rejects.jsonl)
    outside_rows: int = 0  # committed rows whose id is in none of the current input files (kept, not counted)
    redone_rows: int = 0  # committed rows whose input changed, taken out to be done again (input.check_content)
    this_run_rows: int = 0
    this_run_errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0  # generation: from the engine being ready to the last part committed
    load_seconds: float = 0.0  # loading the engine (model, KV cache)
    nothing_to_do: bool = False
    recovered_parts: int = 0
    report_path: str | None = None  # the run's `_report.html`, when one was written
    stopped: str | None = None  # why the run stopped early (SIGTERM, SIGINT, the deadline); None: it finished
    phases: dict[str, Any] | None = None  # where the wall clock went (job/phases.py PhaseTimer.as_dict)

    @property
    def error_rate(self) -> float:
        total = self.rows_done + self.rejects
        return (self.error_rows + self.rejects) / total if total else 0.0

    def describe(self) -> str:
        if self.nothing_to_do:
            head = f"nothing to do: all {self.rows_done} rows are already in {self.output_path}"
        else:
            rate = (self.prompt_tokens + self.completion_tokens) / self.seconds if self.seconds else 0.0
            head = (
                f"{'stopped (' + self.stopped + ')' if self.stopped else 'done'}: {self.this_run_rows} rows in {self.seconds:.1f}s after {self.load_seconds:.1f}s loading "
                f"({self.this_run_rows / self.seconds if self.seconds else 0:.1f} rows/s, {rate:.0f} tokens/s; "
                f"{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens) -> {self.output_path}"
            )
        tail = f"\noutput holds {self.rows_done} of {self.input_rows} rows; {self.error_rows} with errors"
        if self.outside_rows:
            tail += (f"\n{self.outside_rows} more committed rows belong to inputs that are gone "
                     "(ids in none of the current input files); they are kept and not counted")
        if self.redone_rows:
            tail += f"\n{self.redone_rows} rows were done again because their input changed (input.check_content)"
        if self.rejects:
            tail += f"; {self.rejects} input lines rejected (see {layout.rejects_path(self.output_path)})"
        if self.report_path:
            tail += f"\nreport: {self.report_path}"
        return head + tail


def summarize(
    plan: "JobPlan",
    rejects: int,
    stats: Progress,
    seconds: float,
    nothing_to_do: bool = False,
    load_seconds: float = 0.0,
    stopped: str | None = None,
) -> RunSummary:
    """The RunSummary of a run: the output folder's totals (from the manifest) and this run's counters."""
    m = plan.manifest
    return RunSummary(
        output_path=str(plan.output_dir),
        input_rows=plan.ids.num_rows,
        rows_done=sum(p.rows for p in m.parts) - plan.outside_rows,
        error_rows=sum(p.errors for p in m.parts) - plan.outside_errors,
        rejects=rejects,
        outside_rows=plan.outside_rows,
        redone_rows=plan.redone,
        this_run_rows=stats.rows,
        this_run_errors=stats.errors,
        prompt_tokens=stats.prompt_tokens,
        completion_tokens=stats.completion_tokens,
        seconds=seconds,
        load_seconds=load_seconds,
        nothing_to_do=nothing_to_do,
        recovered_parts=plan.recovered,
        stopped=stopped,
    )
