"""Read an output folder the way users do: every reader given the bare folder path (no glob)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import polars as pl

READERS: dict[str, Callable[[Path], pl.DataFrame]] = {}


def reader(name: str):
    def register(fn):
        READERS[name] = fn
        return fn

    return register


@reader("pyarrow.dataset")
def _pyarrow(out: Path) -> pl.DataFrame:
    import pyarrow.dataset as ds

    return pl.from_arrow(ds.dataset(str(out), format="parquet").to_table())  # type: ignore[return-value]


@reader("polars.read_parquet")
def _polars_read(out: Path) -> pl.DataFrame:
    return pl.read_parquet(out)


@reader("polars.scan_parquet")
def _polars_scan(out: Path) -> pl.DataFrame:
    return pl.scan_parquet(out).collect()


@reader("duckdb.read_parquet")
def _duckdb(out: Path) -> pl.DataFrame:
    import duckdb

    con = duckdb.connect()
    try:
        rel = con.sql(f"select * from read_parquet('{out}')")
        table = rel.to_arrow_table() if hasattr(rel, "to_arrow_table") else rel.fetch_arrow_table()
        return pl.from_arrow(table)  # type: ignore[return-value]
    finally:
        con.close()


@reader("pandas.read_parquet")
def _pandas(out: Path) -> pl.DataFrame:
    import pandas as pd

    return pl.from_pandas(pd.read_parquet(out))


def assert_every_reader_sees(out: Path, id_column: str, ids: list[str], columns: list[str]) -> None:
    """Every reader of the folder gets exactly these ids (each once) and exactly these columns."""
    for name, read in READERS.items():
        df = read(out)
        assert df.columns == columns, f"{name}: columns {df.columns} != {columns}"
        got = sorted(str(i) for i in df[id_column].to_list())
        assert got == sorted(ids), f"{name}: {len(got)} rows, not the {len(ids)} output rows"
