"""What an output folder already holds, for a resume: finished ids, their types, rows to redo.

* `read_finished` reads every recorded part's id (as its canonical key, id_key.py), error and
  content-hash columns, part by part, so parts written with different id types (an int32 output
  later widened to int64 or string) resume alike. The manifest's per-part counts are refreshed from
  the parts themselves (a rewrite killed half way leaves them right again).
* `rewrite_parts` writes committed parts again — their id column in a wider type, or without the
  rows whose input changed (`input.check_content`) — each replaced whole (store.py), so a kill
  leaves every part either old or new, never torn; the manifest is saved after each part.
* `row_hash` is the content hash stored per row when `input.check_content` is on.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from batchinfer.io.id_key import IdType, array_keys, convert_array, normalize_type
from batchinfer.io import layout
from batchinfer.io.manifest import Manifest, PartInfo

log = logging.getLogger(__name__)

HASH_COLUMN = "input_hash"
_EMPTY = {"id": pl.Utf8, "error": pl.Boolean, "part": pl.Utf8, "hash": pl.Utf8}


@dataclass
class Finished:
    """The committed rows of an output: one row per committed output row."""

    rows: pl.DataFrame = field(default_factory=lambda: pl.DataFrame(schema=_EMPTY))  # id (key), error, part, hash
    part_types: dict[str, IdType] = field(default_factory=dict)  # part name -> its id column's type

    @property
    def keys(self) -> pl.Series:
        return self.rows.get_column("id")


def read_finished(manifest: Manifest, id_column: str) -> Finished:
    """Every recorded part's ids (canonical keys), errors and content hashes; refreshes part counts."""
    frames: list[pl.DataFrame] = []
    types: dict[str, IdType] = {}
    changed = False
    for i, p in enumerate(manifest.parts):
        path = manifest.folder / p.name
        with path.open_input_file() as fh:
            pf = pq.ParquetFile(fh)  # not read_table: its dataset layer imports pandas
            names = pf.schema_arrow.names
            cols = [c for c in (id_column, "error", HASH_COLUMN) if c in names]
            t = pf.read(columns=cols)
        ids = t.column(id_column) if id_column in names else pa.nulls(t.num_rows, pa.string())
        big = None
        if pa.types.is_integer(ids.type) and t.num_rows:
            mm = pc.min_max(ids).as_py()
            big = max(abs(mm["min"] or 0), abs(mm["max"] or 0))
        types[p.name] = IdType(ids.type, big, str(path))
        err = pc.is_valid(t.column("error")) if "error" in names else pa.array([False] * t.num_rows, pa.bool_())
        hashes = t.column(HASH_COLUMN).cast(pa.string()) if HASH_COLUMN in names else pa.nulls(t.num_rows, pa.string())
        frames.append(pl.DataFrame({
            "id": pl.from_arrow(array_keys(ids)), "error": pl.from_arrow(err),
            "part": [p.name] * t.num_rows, "hash": pl.from_arrow(hashes),
        }, schema=_EMPTY))
        errors = int(pc.sum(err).as_py() or 0)
        if (p.rows, p.errors) != (t.num_rows, errors):
            manifest.parts[i] = PartInfo(p.name, t.num_rows, errors)
            changed = True
    if changed:
        manifest.save()
    rows = pl.concat(frames) if frames else pl.DataFrame(schema=_EMPTY)
    return Finished(rows, types)


def parts_to_widen(finished: Finished, typ: pa.DataType) -> list[str]:
    """Parts whose id column is not of the output's id type `typ`."""
    return [name for name, t in finished.part_types.items() if normalize_type(t.type) != typ and not pa.types.is_null(t.type)]


def rewrite_parts(manifest: Manifest, id_column: str, names: list[str], typ: pa.DataType | None = None,
                  drop: pl.Series | None = None) -> int:
    """Write the named parts again: id column cast to `typ` (keys kept), rows whose key is in `drop` left out.

    Returns the number of rows dropped. A part left without rows is deleted and leaves the manifest.
    """
    dropped = 0
    drop_arr = pa.array(drop.to_list(), pa.string()) if drop is not None and len(drop) else None
    for name in names:
        path = manifest.folder / name
        with path.open_input_file() as fh:
            table = pq.ParquetFile(fh).read()
        meta = table.schema.metadata
        if typ is not None and id_column in table.column_names:
            i = table.column_names.index(id_column)
            table = table.set_column(i, pa.field(id_column, typ), convert_array(table.column(id_column), typ))
        if drop_arr is not None:
            keep = pc.invert(pc.fill_null(pc.is_in(array_keys(table.column(id_column)), value_set=drop_arr), False))
            before = table.num_rows
            table = table.filter(keep)
            dropped += before - table.num_rows
        table = table.replace_schema_metadata(meta)
        if table.num_rows == 0:
            path.delete()
            manifest.parts = [p for p in manifest.parts if p.name != name]
        else:  # the new part replaces the old one whole (store.py: rename locally, one upload remotely)
            with path.open_atomic(tmp_dir=layout.tmp_dir(manifest.folder)) as fh:
                pq.write_table(table, fh, compression="zstd")
            errors = int(pc.sum(pc.is_valid(table.column("error"))).as_py() or 0) if "error" in table.column_names else 0
            manifest.parts = [PartInfo(name, table.num_rows, errors) if p.name == name else p for p in manifest.parts]
        manifest.save()
    return dropped


def _json_default(v: Any) -> Any:
    if isinstance(v, (dt.datetime, dt.date, dt.time)):
        return v.isoformat()
    if isinstance(v, Decimal):
        return str(v)
    if isinstance(v, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, dt.timedelta):
        return {"$seconds": v.total_seconds()}
    return str(v)


def row_hash(values: dict[str, Any]) -> str:
    """A content hash of a whole input row (every column, in name order): sha256 of its JSON, 32 hex digits."""
    text = json.dumps(values, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).hexdigest()[:32]

