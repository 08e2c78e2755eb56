"""Streaming readers for Parquet, JSONL and JSONL.gz shards.

Rows come out in bounded batches of plain dicts (what the prompt template reads), so memory stays
flat for any input size. A JSONL line that is not valid UTF-8, not a JSON object, or has no usable
id (null, missing, a list, NaN...) cannot become an output row: it becomes a `Reject` (file, line
number, start of the line, reason) instead. Every Row carries its id's canonical key (id_key.py).
"""

from __future__ import annotations

import glob as globlib
import gzip
import json
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import pyarrow.parquet as pq

from batchinfer.io.id_key import IdError
from batchinfer.io.id_key import key as id_key

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".ndjson": "jsonl"}
# input.format -> how a file is read (an OpenAI Batch file is JSONL; its lines are read in requests.py)
READ_AS = {"parquet": "parquet", "jsonl": "jsonl", "openai": "jsonl"}


class InputError(ValueError):
    """An input problem that affects the whole job (missing file, no id column, duplicate ids)."""


@dataclass(frozen=True)
class InputFile:
    path: str
    format: str  # parquet | jsonl


@dataclass(frozen=True)
class Reject:
    """An input line that has no usable id, so it cannot become an output row."""

    file: str
    line: int  # 1-based line (JSONL) or row number (Parquet)
    text: str  # the start of the line
    reason: str


@dataclass(frozen=True)
class Row:
    """One input row: its columns, and where it came from (for messages)."""

    values: dict[str, Any]
    file: str
    line: int
    key: str | None = None  # the id's canonical key (batchinfer.io.id_key), set by the readers

    def id_key(self, id_column: str) -> str:
        """The canonical key of this row's id (computed when the row was made elsewhere)."""
        return self.key if self.key is not None else id_key(self.values[id_column])


def _format_of(path: str, forced: str) -> str | None:
    if forced != "auto":
        return READ_AS[forced]
    name = path.lower()
    for suffix, fmt in SUFFIXES.items():
        if name.endswith(suffix):
            return fmt
    return None


def list_input_files(path: str, fmt: str = "auto") -> list[InputFile]:
    """Expand a file, folder or glob into a sorted list of input files (folder: known extensions only)."""
    if any(ch in path for ch in "*?["):
        candidates = sorted(p for p in globlib.glob(path, recursive=True) if Path(p).is_file())
        if not candidates:
            raise InputError(f"input.path: no files match {path}")
    elif Path(path).is_dir():
        candidates = sorted(str(p) for p in Path(path).rglob("*") if p.is_file() and not p.name.startswith(("_", ".")))
        candidates = [p for p in candidates if _format_of(p, "auto")]
        if not candidates:
            raise InputError(f"input.path: folder {path} has no .parquet, .jsonl or .jsonl.gz files")
    elif Path(path).is_file():
        candidates = [path]
    else:
        raise InputError(f"input.path: not found: {path}")
    files = []
    for p in candidates:
        f = _format_of(p, fmt)
        if f is None:
            raise InputError(f"input file {p}: unknown format (use .parquet, .jsonl, .jsonl.gz or set input.format)")
        files.append(InputFile(str(Path(p).resolve()), f))
    return files


BOM = b"\xef\xbb\xbf"


def _open_binary(path: str):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def jsonl_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of each line of a JSONL(.gz) file; a UTF-8 BOM at the start is skipped."""
    with _open_binary(path) as fh:
        for n, raw in enumerate(fh, start=1):
            if n == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            yield n, raw


def _excerpt(raw: bytes) -> str:
    """The start of a line for a reject record (undecodable bytes shown as \\xNN escapes)."""
    return raw[:200].decode("utf-8", errors="backslashreplace").rstrip("\r\n")


def parse_jsonl_line(raw: bytes, n: int, path: str, id_column: str) -> Row | Reject | None:
    """One JSONL line as a Row (with its id's canonical key), a Reject, or None for a blank line.

    Bytes are decoded strictly: a line that is not valid UTF-8 is rejected (file, line, byte offset),
    never silently changed, so an id always joins back to its source byte for byte.
    """
    if not raw.strip():
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        return Reject(path, n, _excerpt(raw), f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start} of the line)")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return Reject(path, n, _excerpt(raw), f"not valid JSON: {e.msg}")
    if not isinstance(obj, dict):
        return Reject(path, n, _excerpt(raw), f"not a JSON object (a {type(obj).__name__})")
    return _row_or_reject(obj, path, n, id_column, lambda: _excerpt(raw))


def _row_or_reject(values: dict[str, Any], path: str, n: int, id_column: str, text: Any) -> Row | Reject:
    v = values.get(id_column)
    if v is None:
        what = "null" if id_column in values else "missing"
        return Reject(path, n, text(), f"id column '{id_column}' is {what}")
    if isinstance(v, (dict, list)):
        return Reject(path, n, text(), f"id column '{id_column}' is not a scalar")
    try:
        k = id_key(v)
    except IdError as e:
        return Reject(path, n, text(), f"id column '{id_column}' {e}")
    return Row(values, path, n, k)


def iter_jsonl(
    file: InputFile, id_column: str, batch_size: int, rejected: Mapping[int, str] | None = None
) -> Iterator[list[Row | Reject]]:
    """Yield batches of Rows and Rejects from one JSONL(.gz) file, in line order.

    rejected: line -> reason for lines that have an id but are rejected anyway (a repeated OpenAI
    custom_id: io/ids.py)."""
    batch: list[Row | Reject] = []
    try:
        for n, raw in jsonl_lines(file.path):
            item = parse_jsonl_line(raw, n, file.path, id_column)
            if item is None:
                continue
            if rejected and n in rejected and isinstance(item, Row):
                item = Reject(file.path, n, _excerpt(raw), rejected[n])
            batch.append(item)
            if len(batch) >= batch_size:
                yield batch
                batch = []
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"cannot read {file.path}: {e}") from None
    if batch:
        yield batch


def iter_parquet(file: InputFile, id_column: str, batch_size: int, columns: list[str] | None = None) -> Iterator[list[Row | Reject]]:
    """Yield batches of Rows from one Parquet file (record batches; only `columns` if given)."""
    try:
        pf = pq.ParquetFile(file.path)
        names = pf.schema_arrow.names
        cols = [c for c in columns if c in names] if columns is not None else None
        line = 0
        for rb in pf.iter_batches(batch_size=batch_size, columns=cols):
            out: list[Row | Reject] = []
            for values in rb.to_pylist():
                line += 1
                out.append(_row_or_reject(values, file.path, line, id_column, lambda: json.dumps(values, default=str)[:200]))
            yield out
    except OSError as e:
        raise InputError(f"cannot read {file.path}: {e}") from None


def iter_rows(
    files: list[InputFile],
    id_column: str,
    batch_size: int,
    columns: list[str] | None = None,
    rejected: Mapping[tuple[str, int], str] | None = None,
) -> Iterator[list[Row | Reject]]:
    """All files in order, batch by batch. `columns` (Parquet only) limits what is read; `rejected`
    ((file, line) -> reason) names JSONL lines to reject although they have an id."""
    for f in files:
        if f.format == "parquet":
            yield from iter_parquet(f, id_column, batch_size, columns)
        else:
            yield from iter_jsonl(f, id_column, batch_size, lines_of(rejected, f.path))


def lines_of(rejected: Mapping[tuple[str, int], str] | None, path: str) -> dict[int, str] | None:
    """The rejected lines of one file (None when it has none)."""
    lines = {line: why for (f, line), why in (rejected or {}).items() if f == path}
    return lines or None


def input_columns(file: InputFile) -> list[str] | None:
    """The columns of a Parquet file (None for JSONL: rows may differ)."""
    if file.format != "parquet":
        return None
    try:
        return pq.ParquetFile(file.path).schema_arrow.names
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise InputError(f"cannot read {file.path}: {e}") from None
