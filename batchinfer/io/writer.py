"""Atomic Parquet part files: rows are buffered, then committed whole as `part-N.parquet` in the
output folder (local disk: a temp file in the records folder's tmp/, fsynced, renamed in; object
store: one upload under the final name, visible only complete; see store.py), then recorded in the
manifest. The output folder never holds anything but complete parts, so any reader of the folder
(polars and DuckDB included, which read every file in it) gets exactly the output.

A part rolls over every `rows_per_part` rows or `seconds_per_part` seconds, so a kill loses at most
one part's worth of work and memory stays bounded.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.io import layout
from batchinfer.io.id_key import to_output
from batchinfer.io.manifest import FINGERPRINT_KEY, Manifest, PartInfo, next_part_number
from batchinfer.io.store import Location

log = logging.getLogger(__name__)

RESULT_FIELDS = [
    pa.field("output_text", pa.string()),
    pa.field("finish_reason", pa.string()),
    pa.field("prompt_tokens", pa.int64()),
    pa.field("completion_tokens", pa.int64()),
    pa.field("error", pa.string()),
    # per-row engine timings (see batchinfer.observe.records.row_metrics); null for rows that never
    # reached the engine (template or length errors)
    pa.field("queue_wait_s", pa.float64()),
    pa.field("ttft_s", pa.float64()),
    pa.field("decode_s", pa.float64()),
]


def output_schema(key_types: dict[str, pa.DataType | None], result_columns: dict[str, pa.DataType]) -> dict[str, pa.DataType | None]:
    """Column name -> type of an output part: the id and kept columns, then the result columns (the
    job's: results.ResultConverter.columns); None types are inferred from the first part's values."""
    cols: dict[str, pa.DataType | None] = dict(key_types)
    cols.update(result_columns)
    return cols


class PartWriter:
    """Buffers finished rows and commits them as part files (see module docstring).

    columns: name -> Arrow type (None: inferred once from the first part, then fixed).
    """

    def __init__(
        self,
        manifest: Manifest,
        columns: dict[str, pa.DataType | None],
        rows_per_part: int,
        seconds_per_part: float,
        on_commit: Callable[[PartInfo], None] | None = None,
    ) -> None:
        self.manifest = manifest
        self.folder = manifest.folder
        self.columns = dict(columns)
        self.rows_per_part = rows_per_part
        self.seconds_per_part = seconds_per_part
        self._buffer: list[dict[str, Any]] = []
        self._started: float | None = None
        self._schema: pa.Schema | None = None
        self._next = next_part_number(self.folder)
        self.rows_written = 0
        self.errors_written = 0
        self.broken = False  # a flush failed part-way: do not try again in this process
        self.on_commit = on_commit  # called after each committed part (e.g. to flush run records with it)

    def add(self, row: dict[str, Any]) -> None:
        if not self._buffer:
            self._started = time.monotonic()
        self._buffer.append(row)
        self.maybe_flush()

    def maybe_flush(self) -> None:
        if not self._buffer:
            return
        due = self._started is not None and time.monotonic() - self._started >= self.seconds_per_part
        if len(self._buffer) >= self.rows_per_part or due:
            self.flush()

    def _resolve_schema(self, rows: list[dict[str, Any]]) -> pa.Schema:
        """The part schema: the given column types, the untyped ones inferred from the first part's rows."""
        if self._schema is None:
            fields = []
            for name, typ in self.columns.items():
                if typ is None:
                    vals = [r.get(name) for r in rows]
                    try:
                        typ = pa.array(vals).type
                    except (pa.ArrowInvalid, pa.ArrowTypeError):
                        typ = pa.string()
                    if pa.types.is_null(typ):
                        typ = pa.string()
                fields.append(pa.field(name, typ))
            self._schema = pa.schema(fields)
        return self._schema

    def _table(self, rows: list[dict[str, Any]]) -> pa.Table:
        schema = self._resolve_schema(rows)
        id_col = self.manifest.id_column
        if id_col in schema.names:  # the id as a value of the output's id type (same canonical key)
            typ = schema.field(id_col).type
            rows = [{**r, id_col: to_output(r.get(id_col), typ)} for r in rows]
        try:
            return pa.Table.from_pylist(rows, schema=schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            return pa.Table.from_pylist([self._coerce(r, schema) for r in rows], schema=schema)

    def _coerce(self, row: dict[str, Any], schema: pa.Schema) -> dict[str, Any]:
        """A row whose kept column does not fit the part's type: null it and say so in `error`."""
        row = dict(row)
        for f in schema:
            if f.name == self.manifest.id_column:
                continue  # the id type holds every input id (plan: id_key.common_type); never null an id
            try:
                pa.array([row.get(f.name)], type=f.type)
            except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
                msg = f"column '{f.name}' value {str(row.get(f.name))[:60]!r} does not fit the output type {f.type}"
                row[f.name] = None
                row["error"] = f"{row['error']}; {msg}" if row.get("error") else msg
                if row.get("finish_reason") != "error":
                    row["finish_reason"] = "error"
        return row

    def flush(self) -> None:
        """Commit the buffered rows as one part (temp name, fsync, rename, manifest)."""
        if not self._buffer:
            return
        self.broken = True
        part = self.commit(self._buffer)
        self._buffer = []
        self._started = None
        self.broken = False
        if self.on_commit is not None:
            self.on_commit(part)

    def commit(self, rows: list[dict[str, Any]]) -> PartInfo:
        """Write `rows` as the next part file and record it in the manifest (the part is complete or absent)."""
        table = self._table(rows)
        meta = dict(table.schema.metadata or {})
        meta[FINGERPRINT_KEY] = self.manifest.fingerprint.encode()
        table = table.replace_schema_metadata(meta)
        name = layout.part_name(self._next)
        with (self.folder / name).open_atomic(tmp_dir=layout.tmp_dir(self.folder)) as fh:
            pq.write_table(table, fh, compression="zstd")
        errors = sum(1 for r in table.column("error").to_pylist() if r is not None)
        part = PartInfo(name, table.num_rows, errors)
        self.manifest.add_part(part)
        log.debug("committed %s (%d rows)", name, table.num_rows)
        self._next += 1
        self.rows_written += table.num_rows
        self.errors_written += errors
        return part

    def save_finished(self) -> None:
        """After a failure elsewhere: commit the rows that did finish (best effort), so a resume skips them."""
        if self.broken:
            return
        try:
            self.flush()
        except Exception as e:  # the original failure matters more
            log.warning("could not save %d finished rows: %s", len(self._buffer), e)

    def close(self) -> None:
        self.flush()


def existing_schema(folder: "str | os.PathLike[str] | Location", part_name: str) -> pa.Schema:
    """The schema of a committed part (resume keeps the same column types)."""
    with (layout.output_dir(folder) / part_name).open_input_file() as fh:
        return pq.read_schema(fh)
