"""Part files written by a worker (a process or a Ray actor) that does not own the manifest.

A worker commits parts exactly as the single-engine writer does (whole under the final name: see
io/writer.py; the part carries the job fingerprint), but the part's number comes from the driver (a shared counter, so two
workers never pick the same name) and the commit is reported, with the part's ids, instead of being
written to the manifest: the driver records it. If the worker dies between the rename and the report,
the driver's recovery (`manifest.recover`) finds the part: it is complete and ours.
"""

from __future__ import annotations

from typing import Any, Callable

import pyarrow as pa

from batchinfer.io import layout
from batchinfer.io.id_key import array_keys
from batchinfer.io.id_key import key as id_key
from batchinfer.io.manifest import Manifest, PartInfo, read_columns
from batchinfer.io.store import Location
from batchinfer.io.writer import PartWriter


class DetachedManifest(Manifest):
    """The manifest as a worker sees it: folder and fingerprint; add_part remembers, never saves."""

    def __init__(self, folder: "str | Location", fingerprint: str, id_column: str) -> None:
        super().__init__(layout.output_dir(folder), fingerprint, {}, id_column)
        self.last: PartInfo | None = None

    def add_part(self, part: PartInfo) -> None:
        self.last = part

    def save(self) -> None:  # the driver owns the manifest file
        raise RuntimeError("a worker never writes the manifest")


class WorkerPartWriter(PartWriter):
    """A PartWriter whose part numbers come from `next_number` and whose commits go to `on_part(part, ids)`."""

    def __init__(
        self,
        folder: "str | Location",
        fingerprint: str,
        id_column: str,
        columns: dict[str, pa.DataType | None],
        rows_per_part: int,
        seconds_per_part: float,
        next_number: Callable[[], int],
        on_part: Callable[[PartInfo, list[str]], None],
    ) -> None:
        self.detached = DetachedManifest(folder, fingerprint, id_column)
        super().__init__(self.detached, columns, rows_per_part, seconds_per_part)
        self.id_column = id_column
        self.next_number = next_number
        self.on_part = on_part

    def flush(self) -> None:
        if not self._buffer:
            return
        ids = [id_key(r[self.id_column]) for r in self._buffer]
        self._next = self.next_number()
        self.detached.last = None
        super().flush()
        part = self.detached.last
        assert part is not None, "PartWriter.flush committed no part"
        self.on_part(part, ids)


def part_ids(folder: "str | Location", name: str, id_column: str) -> list[str]:
    """The ids (canonical keys, like Manifest.finished_ids) of one committed part."""
    table = read_columns([layout.output_dir(folder) / name], [id_column])
    assert table is not None
    return [k for k in array_keys(table.column(id_column)).to_pylist() if k is not None]


def infer_types(columns: dict[str, pa.DataType | None], rows: list[dict[str, Any]]) -> dict[str, pa.DataType | None]:
    """Fix the columns still untyped (JSONL inputs) from sample rows, as PartWriter would from its first part.

    Every worker then writes the same schema; a later value that does not fit is nulled with an error
    by the writer, as in a single-engine run after its first part.
    """
    out = dict(columns)
    for name, typ in columns.items():
        if typ is not None:
            continue
        vals = [r.get(name) for r in rows]
        try:
            typ = pa.array(vals).type
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            typ = pa.string()
        out[name] = pa.string() if pa.types.is_null(typ) else typ
    return out
