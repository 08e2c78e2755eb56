"""Streaming readers for Parquet, JSONL and JSONL.gz shards.

Rows come out in bounded batches of plain dicts (what the prompt template reads), so memory stays
flat for any input size. A JSONL line that is not a JSON object (or has no id) cannot become an
output row: it becomes a `Reject` (file, line number, start of the line, reason) instead.
"""

from __future__ import annotations

import glob as globlib
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import pyarrow.parquet as pq

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


def _open_text(path: str):
    if path.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, "r", encoding="utf-8", errors="replace")


def iter_jsonl(
    file: InputFile, id_column: str, batch_size: int, rejected: Mapping[int, str] | None = None
) -> Iterator[list[Row | Reject]]:
    """Yield batches of Rows and Rejects from one JSONL(.gz) file, in line order.

    rejected: line -> reason for lines that have an id but are rejected anyway (a repeated OpenAI
    custom_id: io/ids.py)."""
    batch: list[Row | Reject] = []
    try:
        with _open_text(file.path) as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    batch.append(Reject(file.path, n, line[:200].rstrip("\n"), f"not valid JSON: {e.msg}"))
                else:
                    if not isinstance(obj, dict):
                        batch.append(Reject(file.path, n, line[:200].rstrip("\n"), f"not a JSON object (a {type(obj).__name__})"))
                    elif obj.get(id_column) is None:
                        what = "null" if id_column in obj else "missing"
                        batch.append(Reject(file.path, n, line[:200].rstrip("\n"), f"id column '{id_column}' is {what}"))
                    elif isinstance(obj[id_column], (dict, list)):
                        batch.append(Reject(file.path, n, line[:200].rstrip("\n"), f"id column '{id_column}' is not a scalar"))
                    elif rejected and n in rejected:
                        batch.append(Reject(file.path, n, line[:200].rstrip("\n"), rejected[n]))
                    else:
                        batch.append(Row(obj, file.path, n))
                if len(batch) >= batch_size:
                    yield batch
                    batch = []
    except (OSError, EOFError, gzip.BadGzipFile) as e:
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
                if values.get(id_column) is None:
                    out.append(Reject(file.path, line, json.dumps(values, default=str)[:200], f"id column '{id_column}' is null"))
                else:
                    out.append(Row(values, file.path, line))
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
