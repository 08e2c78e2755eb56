"""One lazy scan over Parquet files whose columns differ (parts of several runs or versions), on every
polars the project supports: `missing_columns`/`extra_columns` exist from polars 1.31 on; older ones
(the GPU image has 1.30) get the same frame from a diagonal concatenation of per-file scans."""

from __future__ import annotations

from typing import Any

import polars as pl


def scan_parquet_union(paths: list[str], schema: Any = None) -> pl.LazyFrame:
    """The files as one LazyFrame: columns missing in a file come back null; with `schema`, exactly
    its columns (in its order and types), others left out."""
    try:
        return pl.scan_parquet(paths, schema=schema, missing_columns="insert", extra_columns="ignore")
    except TypeError:  # polars < 1.31: no missing_columns / extra_columns
        lf = pl.concat([pl.scan_parquet(p) for p in paths], how="diagonal_relaxed")
        if schema is None:
            return lf
        have = lf.collect_schema().names()
        return lf.select([(pl.col(n) if n in have else pl.lit(None)).cast(t).alias(n) for n, t in schema.items()])
