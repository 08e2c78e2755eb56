"""Whole-job checks of the id column, done cheaply with polars before a run starts.

A missing id column or a duplicate id affects every row (resume could not tell rows apart), so the
job is refused up front, naming one duplicate and the files/rows where it occurs. For OpenAI Batch
files (`duplicates="reject"`) a repeated custom_id is a bad line instead: the first occurrence (in
file order, then line order: the same on every run) is the row, every later one a reject naming it,
so each id still has exactly one row.
"""

from __future__ import annotations

import json
from pathlib import Path
from dataclasses import dataclass, field
from typing import Literal

import polars as pl

from batchinfer.io.readers import InputError, InputFile, _open_text, input_columns


@dataclass(frozen=True)
class IdCheck:
    """Every usable id of the input (as text, with where it is), and how many rows have one."""

    ids: pl.DataFrame  # columns: id (str), file (str), line (int); one row per id
    rejected: dict[tuple[str, int], str] = field(default_factory=dict)  # (file, line) of a repeated id -> why

    @property
    def num_rows(self) -> int:
        return self.ids.height


def _kind(value_type: str) -> str:
    """A coarse kind of an id's type, so that mixing e.g. integers and strings is caught up front."""
    if value_type.startswith(("int", "uint")) or value_type == "int":
        return "integer"
    if value_type in ("string", "large_string", "str", "string_view"):
        return "string"
    return value_type


def _parquet_ids(f: InputFile, id_column: str, kinds: dict[str, str]) -> pl.LazyFrame:
    cols = input_columns(f) or []
    if id_column not in cols:
        raise InputError(f"{f.path}: no id column '{id_column}' (columns: {', '.join(cols)})")
    import pyarrow.parquet as pq

    kinds.setdefault(_kind(str(pq.read_schema(f.path).field(id_column).type)), f.path)
    return (
        pl.scan_parquet(f.path)
        .select(pl.col(id_column).cast(pl.Utf8).alias("id"))
        .with_row_index("line", offset=1)
        .filter(pl.col("id").is_not_null())
        .with_columns(pl.lit(f.path).alias("file"), pl.col("line").cast(pl.Int64))
        .select("id", "file", "line")
    )


def _jsonl_ids(f: InputFile, id_column: str, kinds: dict[str, str]) -> pl.LazyFrame:
    ids: list[str] = []
    lines: list[int] = []
    objects = 0
    try:
        with _open_text(f.path) as fh:
            for n, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(obj, dict):
                    continue
                objects += 1
                v = obj.get(id_column)
                if v is None or isinstance(v, (dict, list)):
                    continue
                kinds.setdefault(_kind(type(v).__name__), f"{f.path} line {n}")
                ids.append(str(v))
                lines.append(n)
    except (OSError, EOFError) as e:
        raise InputError(f"cannot read {f.path}: {e}") from None
    if objects and not ids:
        raise InputError(f"{f.path}: no row has the id column '{id_column}'")
    return pl.LazyFrame({"id": ids, "file": [f.path] * len(ids), "line": lines}, schema={"id": pl.Utf8, "file": pl.Utf8, "line": pl.Int64})


def check_ids(files: list[InputFile], id_column: str, duplicates: Literal["stop", "reject"] = "stop") -> IdCheck:
    """Refuse a missing id column or (duplicates "stop") duplicate ids; return all ids (for counting
    pending rows). duplicates "reject": later occurrences of an id become `rejected` lines."""
    kinds: dict[str, str] = {}  # kind of id -> where it is first seen
    frames = [_parquet_ids(f, id_column, kinds) if f.format == "parquet" else _jsonl_ids(f, id_column, kinds) for f in files]
    if len(kinds) > 1:
        seen = "; ".join(f"{k} at {where}" for k, where in kinds.items())
        raise InputError(f"id column '{id_column}' mixes types ({seen}); give every row an id of one type")
    try:
        ids = pl.concat(frames).collect()
    except pl.exceptions.PolarsError as e:
        raise InputError(f"cannot read the id column '{id_column}': {e}") from None
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
        return _reject_repeats(ids, id_column)
    if dups.height:
        row = dups.row(0, named=True)
        where = "; ".join(f"{fi} line {li}" for fi, li in list(zip(row["file"], row["line"]))[:3])
        raise InputError(f"duplicate id {row['id']!r} in column '{id_column}' ({len(row['file'])} times: {where})")
    return IdCheck(ids)


def _reject_repeats(ids: pl.DataFrame, id_column: str) -> IdCheck:
    """Keep each id's first occurrence (files in order, lines ascending); the later ones are rejected."""
    first = ids.select(pl.col("id").is_first_distinct()).to_series()
    kept = ids.filter(first)
    where = {r["id"]: (r["file"], r["line"]) for r in kept.filter(pl.col("id").is_in(ids.filter(~first)["id"].implode())).iter_rows(named=True)}
    rejected = {}
    for r in ids.filter(~first).iter_rows(named=True):
        f, line = where[r["id"]]
        rejected[(r["file"], r["line"])] = f"duplicate {id_column} {r['id']!r} (first at {Path(f).name} line {line}, which is the one answered)"
    return IdCheck(kept, rejected)
