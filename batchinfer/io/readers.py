"""Streaming readers for Parquet, JSONL and JSONL.gz shards, on the local disk or any store (store.py).

Rows come out in bounded batches of plain dicts (what the prompt template reads), so memory stays
flat for any input size. A JSONL line that is not valid UTF-8, not a JSON object, or has no usable
id (null, missing, a list, NaN...) cannot become an output row: it becomes a `Reject` (file, line
number, start of the line, reason) instead. Every Row carries its id's canonical key (id_key.py).

Hive partitions: below a folder (or a glob's fixed prefix), path segments `key=value` become columns
of every row of the files under them (`year=2024/month=01/part.parquet` gives year 2024 and month 1),
typed as pyarrow's hive partitioning infers them (int32 when every value of the key is an integer
that fits, else string; `__HIVE_DEFAULT_PARTITION__` is null). A column of the file itself with the
same name wins over the path's value.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.io.id_key import IdError
from batchinfer.io.id_key import key as id_key
from batchinfer.io.store import Location, StoreError, expand_glob, has_glob, location

SUFFIXES = {".parquet": "parquet", ".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".ndjson": "jsonl"}
# input.format -> how a file is read (an OpenAI Batch file is JSONL; its lines are read in requests.py)
READ_AS = {"parquet": "parquet", "jsonl": "jsonl", "openai": "jsonl"}
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
_INT = re.compile(r"^-?[0-9]+$")


class InputError(ValueError):
    """An input problem that affects the whole job (missing file, no id column, duplicate ids)."""


@dataclass(frozen=True)
class InputFile:
    """One input file: its path (a local path or a URI), format, and hive partition values."""

    path: str
    format: str  # parquet | jsonl
    partitions: tuple[tuple[str, Any], ...] = ()  # (column, typed value) from the path's key=value folders
    loc: Location | None = field(default=None, compare=False, repr=False)

    @property
    def location(self) -> Location:
        return self.loc if self.loc is not None else location(self.path)

    def open_file(self) -> Any:
        """A random-access binary file (Parquet)."""
        return self.location.open_input_file()

    def open_binary(self) -> Any:
        """The file's bytes as a stream, gunzipped for a .gz name."""
        raw = self.location.open_input_stream()
        return gzip.GzipFile(fileobj=raw, mode="rb") if self.path.lower().endswith(".gz") else raw


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


def _hidden(parts: list[str]) -> bool:
    return any(p.startswith(("_", ".")) for p in parts)


def list_input_files(path: str, fmt: str = "auto") -> list[InputFile]:
    """Expand a file, folder or glob (local or a URI) into a sorted list of input files.

    A folder is searched at every depth for known extensions, skipping names that start with `_` or `.`
    (at any depth, as pyarrow's dataset discovery does). Folders and globs give hive partition columns.
    """
    try:
        if has_glob(path):
            root, found = expand_glob(path)
            if not found:
                raise InputError(f"input.path: no files match {path}")
        else:
            target = location(path)
            kind = "dir" if target.is_dir() else ("file" if target.is_file() else None)
            if kind == "dir":
                root = target
                found = [f for f in target.files(recursive=True) if not _hidden(f.relative_parts(root)) and _format_of(f.name, "auto")]
                if not found:
                    raise InputError(f"input.path: folder {path} has no .parquet, .jsonl or .jsonl.gz files")
            elif kind == "file":
                root, found = None, [target]
            else:
                raise InputError(f"input.path: not found: {path}")
    except (StoreError, OSError) as e:
        raise InputError(f"input.path {path}: {e}") from None
    partitions = hive_partitions(root, found) if root is not None else [()] * len(found)
    files = []
    for loc, parts in zip(found, partitions):
        local = loc.local_path()
        name = str(loc) if local is None else str(local.resolve())
        f = _format_of(name, fmt)
        if f is None:
            raise InputError(f"input file {name}: unknown format (use .parquet, .jsonl, .jsonl.gz or set input.format)")
        files.append(InputFile(name, f, parts, loc))
    return files


# ---- hive partitions -------------------------------------------------------------------------------


def hive_partitions(root: Location, files: list[Location]) -> list[tuple[tuple[str, Any], ...]]:
    """Per file, its (column, typed value) pairs from the `key=value` folders between root and the file."""
    raw: list[dict[str, str | None]] = []
    for f in files:
        keys: dict[str, str | None] = {}
        for seg in f.relative_parts(root)[:-1]:
            k, sep, v = seg.partition("=")
            if sep and k:
                keys[unquote(k)] = None if v == HIVE_NULL else unquote(v)
        raw.append(keys)
    names = list(dict.fromkeys(k for r in raw for k in r))
    types = {n: partition_type([r[n] for r in raw if r.get(n) is not None]) for n in names}
    out = []
    for r in raw:
        vals = []
        for n in names:
            v = r.get(n)
            vals.append((n, int(v) if v is not None and types[n] == pa.int32() else v))
        out.append(tuple(vals))
    return out


def partition_type(values: list[str]) -> pa.DataType:
    """int32 when every value is an integer within int32 (as pyarrow infers), else string."""
    if values and all(_INT.match(v) and -(2**31) <= int(v) < 2**31 for v in values):
        return pa.int32()
    return pa.string()


def partition_types(files: list[InputFile]) -> dict[str, pa.DataType]:
    """The Arrow type of each partition column of the input."""
    out: dict[str, pa.DataType] = {}
    for f in files:
        for name, value in f.partitions:
            if value is not None:
                out[name] = pa.int32() if isinstance(value, int) else pa.string()
            else:
                out.setdefault(name, pa.string())
    return out


def _with_partitions(item: "Row | Reject", file: InputFile) -> "Row | Reject":
    """A Row with its file's partition columns added (the file's own columns win)."""
    if not file.partitions or not isinstance(item, Row):
        return item
    values = {**{k: v for k, v in file.partitions if k not in item.values}, **item.values}
    return dataclasses.replace(item, values=values)


# ---- reading -----------------------------------------------------------------------------------------


BOM = b"\xef\xbb\xbf"


def jsonl_lines(file: "InputFile | str") -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw bytes) of each line of a JSONL(.gz) file; a UTF-8 BOM at the start is skipped."""
    if isinstance(file, str):
        file = InputFile(file, "jsonl")
    with file.open_binary() as fh:
        for n, raw in enumerate(_lines(fh), start=1):
            if n == 1 and raw.startswith(BOM):
                raw = raw[len(BOM):]
            yield n, raw


def _lines(fh: Any, chunk: int = 1 << 20) -> Iterator[bytes]:
    """The lines of a binary stream, each with its newline, read in chunks (a store's input stream,
    such as pyarrow's, need not support readline)."""
    rest = b""
    while True:
        data = fh.read(chunk)
        if not data:
            break
        data, start = rest + data, 0
        while (end := data.find(b"\n", start)) >= 0:
            yield data[start : end + 1]
            start = end + 1
        rest = data[start:]
    if rest:
        yield rest


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
        for n, raw in jsonl_lines(file):
            item = parse_jsonl_line(raw, n, file.path, id_column)
            if item is None:
                continue
            if rejected and n in rejected and isinstance(item, Row):
                item = Reject(file.path, n, _excerpt(raw), rejected[n])
            batch.append(_with_partitions(item, file))
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
        with file.open_file() as fh:
            pf = pq.ParquetFile(fh)
            names = pf.schema_arrow.names
            cols = [c for c in columns if c in names] if columns is not None else None
            line = 0
            for rb in pf.iter_batches(batch_size=batch_size, columns=cols):
                out: list[Row | Reject] = []
                for values in rb.to_pylist():
                    line += 1
                    item = _row_or_reject(values, file.path, line, id_column, lambda: json.dumps(values, default=str)[:200])
                    out.append(_with_partitions(item, file))
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


def parquet_schema(file: InputFile) -> pa.Schema:
    """The Arrow schema of a Parquet file (its own columns, without partition columns)."""
    try:
        with file.open_file() as fh:
            return pq.ParquetFile(fh).schema_arrow
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise InputError(f"cannot read {file.path}: {e}") from None


def input_columns(file: InputFile) -> list[str] | None:
    """The columns of a Parquet file and its partition columns (None for JSONL: rows may differ)."""
    if file.format != "parquet":
        return None
    names = parquet_schema(file).names
    return names + [k for k, _ in file.partitions if k not in names]
