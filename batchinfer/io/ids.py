"""Whole-job checks of the id column, done before a run starts.

A missing id column or a duplicate id affects every row (resume could not tell rows apart), so the
job is refused up front, naming one duplicate and the files/rows where it occurs. For OpenAI Batch
files (`duplicates="reject"`) a repeated custom_id is a bad line instead: the first occurrence (in
file order, then line order: the same on every run) is the row, every later one a reject naming it,
so each id still has exactly one row. Ids are compared by their canonical key (id_key.py), so 7,
7.0 and "7" are one id, and the check sees exactly what resume sees. Each file's id type is
recorded, for the output column's common type.
"""

from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.io.id_key import IdType, array_keys, common_type, python_id_type
from batchinfer.io.readers import InputError, InputFile, Row, input_columns, jsonl_lines, parquet_schema, parse_jsonl_line


@dataclass(frozen=True)
class IdCheck:
    """Every usable id of the input (its canonical key, with where it is), and each file's id type."""

    ids: pl.DataFrame  # columns: id (str: the canonical key), file (str), line (int); one row per id
    types: tuple[IdType, ...] = ()
    rejected: dict[tuple[str, int], str] = field(default_factory=dict)  # (file, line) of a repeated id -> why

    @property
    def num_rows(self) -> int:
        return self.ids.height

    @property
    def id_type(self) -> IdType | None:
        """The common type of every input file's ids (None: no ids at all)."""
        return common_type(self.types)


def _parquet_ids(f: InputFile, id_column: str, types: list[IdType]) -> pl.DataFrame:
    if id_column not in parquet_schema(f).names:
        cols = input_columns(f) or []
        raise InputError(f"{f.path}: no id column '{id_column}' (columns: {', '.join(cols)})")
    try:
        with f.open_file() as fh:
            col = pq.ParquetFile(fh).read(columns=[id_column]).column(id_column)  # not read_table: its dataset layer imports pandas
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise InputError(f"cannot read {f.path}: {e}") from None
    big = None
    if pa.types.is_integer(col.type) and len(col):
        mm = pc.min_max(col).as_py()
        big = max(abs(mm["min"] or 0), abs(mm["max"] or 0))
    types.append(IdType(col.type, big, f.path))
    keys = pl.from_arrow(array_keys(col)).alias("id")
    frame = pl.DataFrame({"id": keys}).with_row_index("line", offset=1).with_columns(pl.col("line").cast(pl.Int64))
    return frame.filter(pl.col("id").is_not_null()).with_columns(pl.lit(f.path).alias("file")).select("id", "file", "line")


def _jsonl_ids(f: InputFile, id_column: str, types: list[IdType]) -> pl.DataFrame:
    ids: list[str] = []
    lines: list[int] = []
    values: list[object] = []
    objects = 0
    try:
        for n, raw in jsonl_lines(f):
            item = parse_jsonl_line(raw, n, f.path, id_column)
            if item is None:
                continue
            if isinstance(item, Row):
                objects += 1
                ids.append(item.key)  # type: ignore[arg-type]
                lines.append(n)
                values.append(item.values[id_column])
            elif "id column" in item.reason:
                objects += 1
    except (OSError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise InputError(f"cannot read {f.path}: {e}") from None
    if objects and not ids:
        raise InputError(f"{f.path}: no row has the id column '{id_column}'")
    t = python_id_type(values, f.path)
    if t is not None:
        types.append(t)
    return pl.DataFrame({"id": ids, "file": [f.path] * len(ids), "line": lines}, schema={"id": pl.Utf8, "file": pl.Utf8, "line": pl.Int64})


def check_ids(files: list[InputFile], id_column: str, duplicates: Literal["stop", "reject"] = "stop") -> IdCheck:
    """Refuse a missing id column or (duplicates "stop") duplicate ids; return all ids (for counting
    pending rows). duplicates "reject": later occurrences of an id become `rejected` lines."""
    types: list[IdType] = []
    frames = [_parquet_ids(f, id_column, types) if f.format == "parquet" else _jsonl_ids(f, id_column, types) for f in files]
    ids = pl.concat(frames) if frames else pl.DataFrame(schema={"id": pl.Utf8, "file": pl.Utf8, "line": pl.Int64})
    dups = (
        ids.lazy()
        .filter(pl.col("id").is_duplicated())
        .sort("file", "line")
        .group_by("id", maintain_order=True)
        .agg(pl.col("file"), pl.col("line"))
        .head(1)
        .collect()
    )
    if dups.height and duplicates == "reject":
        return _reject_repeats(ids, id_column, tuple(types))
    if dups.height:
        row = dups.row(0, named=True)
        where = "; ".join(f"{fi} line {li}" for fi, li in list(zip(row["file"], row["line"]))[:3])
        raise InputError(
            f"duplicate id {row['id']!r} in column '{id_column}' ({len(row['file'])} times: {where}); "
            "ids are compared by their canonical text, so 7, 7.0 and \"7\" are the same id"
        )
    return IdCheck(ids, tuple(types))


def _reject_repeats(ids: pl.DataFrame, id_column: str, types: tuple[IdType, ...]) -> IdCheck:
    """Keep each id's first occurrence (files in order, lines ascending); the later ones are rejected."""
    first = ids.select(pl.col("id").is_first_distinct()).to_series()
    kept = ids.filter(first)
    where = {r["id"]: (r["file"], r["line"]) for r in kept.filter(pl.col("id").is_in(ids.filter(~first)["id"].implode())).iter_rows(named=True)}
    rejected = {}
    for r in ids.filter(~first).iter_rows(named=True):
        f, line = where[r["id"]]
        rejected[(r["file"], r["line"])] = f"duplicate {id_column} {r['id']!r} (first at {Path(f).name} line {line}, which is the one answered)"
    return IdCheck(kept, types, rejected)


def describe_types(types: tuple[IdType, ...] | list[IdType]) -> str:
    """'int64 (a.parquet), string (b.jsonl)' for a log line about mixed id types."""
    seen: dict[str, str] = {}
    for t in types:
        seen.setdefault(str(t.type), Path(t.where).name if t.where else "?")
    return ", ".join(f"{k} ({v})" for k, v in seen.items())

