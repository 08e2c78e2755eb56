"""Step and row records persisted beside the output, so a report can be rebuilt after the run.

Layout (in the output's records folder, beside the output: see batchinfer/io/layout.py):
  steps_dir(out)/part-<run_id>-<n>.parquet   one row per engine step   (STEP_SCHEMA)
  rows_dir(out)/part-<run_id>-<n>.parquet    one row per finished row  (ROW_SCHEMA)

A row record's `excerpt` (the start of the row's input, for the report's sample answers) is kept
only for a few rows of each run, see Observer.

Why folders of small parts and not one file: a run can die at any moment (kill -9) and be resumed.
Records are flushed every `flush_rows` records or `flush_s` seconds as complete parts (temp name, then
rename), so what a dead run had seen survives, and a resumed run adds parts under a new `run_id`
instead of overwriting. A row may then be recorded twice (finished before the crash but not committed
to the output, and done again); readers keep the last record of each id and, where the output has a
manifest, only the ids the output holds (see report.py).

Times: `t` columns are seconds since the run's Observer was created (perf_counter based), so the step
and row records of one run share a time axis.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import polars as pl

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.engine.request import RequestTimes, Result
from batchinfer.engine.stats import StepStats
from batchinfer.io.layout import ROWS_DIR, STEPS_DIR  # noqa: F401  (names re-exported)
from batchinfer.io.store import Location, location

log = logging.getLogger(__name__)

STEP_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("t", pa.float64()),
        ("num_running", pa.int32()),
        ("num_waiting", pa.int32()),
        ("num_prefill_tokens", pa.int32()),
        ("num_decode_tokens", pa.int32()),
        ("num_draft_tokens", pa.int32()),
        ("num_context_tokens", pa.int64()),
        ("kv_blocks_used", pa.int32()),
        ("kv_blocks_free", pa.int32()),
        ("num_preemptions", pa.int32()),
        ("num_finished", pa.int32()),
        ("schedule_ms", pa.float64()),
        ("step_ms", pa.float64()),
        # speculative decoding (StepStats spec_*; 0 when off)
        ("spec_drafted", pa.int32()),
        ("spec_verified", pa.int32()),
        ("spec_accepted", pa.int32()),
        ("spec_rows", pa.int32()),
        ("spec_decode_rows", pa.int32()),
        ("spec_emitted", pa.int32()),
        # of the drafts: grammar-forced tokens and the forced text's tokens (the rest n-gram)
        ("spec_forced_drafted", pa.int32()),
        ("spec_forced_verified", pa.int32()),
        ("spec_forced_accepted", pa.int32()),
        ("spec_text_drafted", pa.int32()),
        ("spec_text_verified", pa.int32()),
        ("spec_text_accepted", pa.int32()),
    ]
)

SPEC_FIELDS = ("drafted", "verified", "accepted", "rows", "decode_rows", "emitted", "forced_drafted", "forced_verified",
               "forced_accepted", "text_drafted", "text_verified", "text_accepted")

ROW_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("id", pa.string()),
        ("finish_reason", pa.string()),
        ("failed", pa.bool_()),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("num_preemptions", pa.int32()),
        ("queue_wait_s", pa.float64()),
        ("ttft_s", pa.float64()),
        ("decode_s", pa.float64()),
        ("latency_s", pa.float64()),
        ("finished_t", pa.float64()),
        ("error", pa.string()),
        ("excerpt", pa.string()),
    ]
)


def new_run_id() -> str:
    """A unique run id that sorts in start order: UTC time to the microsecond, process id, random tag."""
    now = time.time()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}"
    return f"{stamp}-{os.getpid()}-{os.urandom(2).hex()}"


def _diff(later: float | None, earlier: float | None) -> float | None:
    if later is None or earlier is None:
        return None
    return max(0.0, later - earlier)


def row_metrics(result: Any) -> dict[str, float | None]:
    """Per-row timings for the writer to add as columns (None where the engine gave no time).

    result: an engine Result, or anything with its `times` (RequestTimes or None), e.g. the driver's
    RowRecord. queue_wait_s: arrival to first scheduling; ttft_s: arrival to the first output token;
    decode_s: first output token to finish.
    """
    t: RequestTimes | None = getattr(result, "times", None)
    if t is None:
        return {"queue_wait_s": None, "ttft_s": None, "decode_s": None}
    return {
        "queue_wait_s": _diff(t.scheduled, t.arrived),
        "ttft_s": _diff(t.first_token, t.arrived),
        "decode_s": _diff(t.finished, t.first_token),
    }


def step_record(run_id: str, stats: StepStats, t0: float) -> dict[str, Any]:
    """One `steps` record from the engine's StepStats (t relative to the run start t0)."""
    return {
        "run_id": run_id,
        "step": stats.step,
        "t": stats.time - t0,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_prefill_tokens": stats.num_prefill_tokens,
        "num_decode_tokens": stats.num_decode_tokens,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_context_tokens": stats.num_context_tokens,
        "kv_blocks_used": stats.kv_blocks_used,
        "kv_blocks_free": stats.kv_blocks_free,
        "num_preemptions": stats.num_preemptions,
        "num_finished": stats.num_finished,
        "schedule_ms": stats.schedule_ms,
        "step_ms": stats.step_ms,
        **{f"spec_{k}": getattr(stats, f"spec_{k}") for k in SPEC_FIELDS},
    }


@dataclass(frozen=True)
class RowOutcome:
    """What one output row ended as: the fields the records, metrics and report need.

    finish_reason and error are the OUTPUT row's (the driver may turn an engine success into an
    error, e.g. an answer that fails its schema); times is None for rows that never reached the engine.
    """

    row_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    times: RequestTimes | None = None
    num_preemptions: int = 0
    excerpt: str | None = None  # the start of the row's input (see requests.input_excerpt)

    @property
    def failed(self) -> bool:
        return self.error is not None or self.finish_reason == "error"

    @classmethod
    def of_result(cls, row_id: Any, result: Result, finish_reason: str | None = None,
                  error: str | None = None) -> "RowOutcome":
        """From an engine Result; finish_reason / error override the Result's when given."""
        return cls(str(row_id), finish_reason or result.finish_reason, result.prompt_tokens,
                   result.completion_tokens, error if error is not None else result.error, result.times,
                   result.num_preemptions)

    @classmethod
    def of_record(cls, record: Any) -> "RowOutcome":
        """From the driver's run.RowRecord (duck-typed; `error` is used when the record has one)."""
        return cls(str(record.row_id), record.finish_reason, int(record.prompt_tokens or 0),
                   int(record.completion_tokens or 0), getattr(record, "error", None), record.times,
                   int(getattr(record, "num_preemptions", 0) or 0), getattr(record, "excerpt", None))

    @property
    def kind(self) -> str | None:
        """The error's kind (error_kind), None for a row without error."""
        return error_kind(self.error) if self.failed else None


def error_kind(message: str | None) -> str:
    """A short class of an error message: the text before its first ':' (what our errors start with)."""
    if not message:
        return "unknown"
    head = message.split(":", 1)[0].strip()
    return (head or message.strip())[:80]


def row_record(run_id: str, row: RowOutcome, t0: float, keep_excerpt: bool = True) -> dict[str, Any]:
    """One `rows` record: token counts, finish reason, error, timings (t relative to the run start t0),
    and the input excerpt when keep_excerpt."""
    t = row.times
    rec: dict[str, Any] = {
        "run_id": run_id,
        "id": row.row_id,
        "finish_reason": row.finish_reason,
        "failed": row.failed,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "num_preemptions": row.num_preemptions,
        "error": row.error,
        "excerpt": row.excerpt if keep_excerpt else None,
    }
    rec.update(row_metrics(row))
    rec["latency_s"] = _diff(t.finished, t.arrived) if t is not None else None
    rec["finished_t"] = (t.finished - t0) if t is not None and t.finished is not None else None
    return rec


@dataclass(frozen=True)
class SinkConfig:
    """Where a PartSink writes and how often it flushes."""

    folder: Location
    schema: pa.Schema
    run_id: str
    flush_rows: int = 10_000
    flush_s: float = 30.0


class PartSink:
    """Collects records and writes them as complete Parquet parts (atomic: temp file, then rename)."""

    def __init__(self, config: SinkConfig) -> None:
        self.config = config
        self._buffer: list[dict[str, Any]] = []
        self._part = 0
        self._last_flush = time.monotonic()
        self.rows_written = 0

    def add(self, record: dict[str, Any]) -> None:
        self._buffer.append(record)
        due = time.monotonic() - self._last_flush >= self.config.flush_s
        if len(self._buffer) >= self.config.flush_rows or due:
            self.flush()

    def flush(self) -> Location | None:
        """Write the buffered records as one part; returns its location (None when nothing was buffered)."""
        self._last_flush = time.monotonic()
        if not self._buffer:
            return None
        cfg = self.config
        table = pa.Table.from_pylist(self._buffer, schema=cfg.schema)
        final = self._write(table)
        self.rows_written += table.num_rows
        self._buffer.clear()
        return final

    def _write(self, table: pa.Table) -> Location:
        cfg = self.config
        folder = location(cfg.folder)
        folder.makedirs()
        final = folder / f"part-{cfg.run_id}-{self._part:05d}.parquet"
        with final.open_atomic() as fh:
            pq.write_table(table, fh)
        self._part += 1
        return final

    def compact(self) -> Location | None:
        """Flush, then merge this run's parts into one (a long run leaves hundreds of small parts).

        The merged part is written (atomically) before the small ones are deleted; a crash in between
        leaves both, which readers tolerate because they de-duplicate (rows by id, steps by run and step).
        """
        self.flush()
        cfg = self.config
        mine = [f for f in part_locations(location(cfg.folder)) if f.name.startswith(f"part-{cfg.run_id}-")]
        if len(mine) < 2:
            return mine[0] if mine else None
        merged = self._write(read_part_tables(mine, cfg.schema))
        for p in mine:
            p.delete()
        return merged


def part_locations(folder: "str | os.PathLike[str] | Location") -> list[Location]:
    """The complete parts of a record folder, in name (= run, then part) order."""
    return [f for f in location(folder).files() if f.name.startswith("part-") and f.name.endswith(".parquet")]


def part_paths(folder: "str | os.PathLike[str] | Location") -> list[str]:
    """part_locations as path/URI strings."""
    return [str(f) for f in part_locations(folder)]


def read_part_tables(parts: list[Location], schema: pa.Schema) -> pa.Table:
    """The records of these parts as one table of `schema`: columns an older batchinfer did not write
    come back as nulls, columns this one does not know are left out (an empty table for no parts)."""
    tables = []
    for p in parts:
        with p.open_input_file() as fh:
            t = pq.ParquetFile(fh).read()  # not pq.read_table: its dataset layer imports pandas (~0.5 s at a run's end)
        cols = [t.column(f.name).cast(f.type) if f.name in t.column_names else pa.nulls(t.num_rows, f.type) for f in schema]
        tables.append(pa.Table.from_arrays(cols, schema=schema))
    return pa.concat_tables(tables) if tables else schema.empty_table()


def read_parts(folder: "str | os.PathLike[str] | Location", schema: pa.Schema) -> pl.DataFrame:
    """All parts of a record folder as one polars frame of `schema` (see read_part_tables)."""
    frame = pl.from_arrow(read_part_tables(part_locations(folder), schema))
    assert isinstance(frame, pl.DataFrame)
    return frame
