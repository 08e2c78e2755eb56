"""io/scan.py: one scan over parts whose columns differ, also on polars without missing_columns (the GPU image's 1.30)."""

from unittest import mock

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.io.scan import scan_parquet_union


def _parts(tmp_path):
    pq.write_table(pa.table({"a": [1], "b": ["x"]}), tmp_path / "1.parquet")
    pq.write_table(pa.table({"a": [2], "c": [1.5]}), tmp_path / "2.parquet")
    return [str(tmp_path / "1.parquet"), str(tmp_path / "2.parquet")]


def _old_polars(real=pl.scan_parquet):
    def scan(*args, **kwargs):
        if "missing_columns" in kwargs:
            raise TypeError("scan_parquet() got an unexpected keyword argument 'missing_columns'")
        return real(*args, **kwargs)

    return mock.patch.object(pl, "scan_parquet", scan)


def test_schema_gives_its_columns_on_new_and_old_polars(tmp_path):
    paths = _parts(tmp_path)
    schema = pl.Schema({"a": pl.Int64, "c": pl.Float64, "z": pl.Utf8})
    new = scan_parquet_union(paths, schema).collect().sort("a")
    with _old_polars():
        old = scan_parquet_union(paths, schema).collect().sort("a")
    for frame in (new, old):
        assert frame.schema == schema
        assert frame["a"].to_list() == [1, 2] and frame["c"].to_list() == [None, 1.5]


def test_old_polars_keeps_every_row(tmp_path):
    with _old_polars():
        frame = scan_parquet_union(_parts(tmp_path)).collect()
    assert sorted(frame["a"].to_list()) == [1, 2]
