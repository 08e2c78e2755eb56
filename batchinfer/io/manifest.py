"""The output folder's manifest: which part files are committed, and the job's fingerprint.

Commit protocol (exactly once across kill -9 at any moment, on the local disk and on object stores):
  1. a part is written whole under its final name `part-N.parquet` in the output folder: on the local
     disk as a temp file in the records folder's `tmp/`, fsynced, then renamed into the folder (and the
     folder fsynced); on an object store uploaded in one stream, which becomes visible only complete
     (see store.py). The part carries the job fingerprint in its Parquet metadata;
  2. the manifest (`manifest.json` in the records folder, see layout.py) is rewritten atomically with
     the part added.
A kill between 1 and 2 leaves a committed-but-unrecorded part. On start we RECOVER it: a complete
`part-*.parquet` (it can only exist complete) with our fingerprint is added to the manifest; an
unreadable one is deleted; one of another fingerprint stops the run (never deleted without
--overwrite). A recovered part's rows were pending when it was written, so they are in no other part:
recovering it never duplicates a row. Stray temp files are deleted. Finished ids come from the
recorded parts, compared by their canonical key (id_key.py) whatever type each part holds them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.io.scan import scan_parquet_union
from batchinfer.io import layout
from batchinfer.io.layout import PART_RE
from batchinfer.io.store import Location, LockedError, fsync_dir, location

log = logging.getLogger(__name__)

FINGERPRINT_KEY = b"batchinfer.fingerprint"
READ_THREADS = 8  # parts read at once from a remote store (each read is a few round trips)

__all__ = [
    "FINGERPRINT_KEY", "Manifest", "PART_RE", "PartInfo", "atomic_write_text", "clear_output", "component_hashes",
    "fingerprint_of", "fsync_dir", "has_output", "lock_output", "next_part_number", "part_files", "read_columns",
    "read_tables", "recover", "remove_temp_files", "scan_parts",
]


def atomic_write_text(path: "str | os.PathLike[str] | Location", text: str) -> None:
    """Write `text` to `path` so that readers see the old or the new file, never a torn one."""
    location(path).write_text(text)


def fingerprint_of(components: dict[str, Any]) -> str:
    """A stable hash of the things that change outputs (model, prompt, sampling, schema, columns)."""
    text = json.dumps(components, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def component_hashes(components: dict[str, Any]) -> dict[str, str]:
    return {k: fingerprint_of({k: v}) for k, v in sorted(components.items())}


def read_tables(paths: list[Location], columns: list[str] | None) -> list[pa.Table]:
    """The given columns of each Parquet file, in order. Remote files are read a few at a time."""

    def one(loc: Location) -> pa.Table:
        with loc.open_input_file() as fh:  # ParquetFile, not read_table: its dataset layer imports pandas
            return pq.ParquetFile(fh).read(columns=columns)

    if not paths or paths[0].atomic_rename or len(paths) == 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(READ_THREADS) as pool:
        return list(pool.map(one, paths))


def scan_parts(paths: list[Location]) -> pl.LazyFrame:
    """Parquet parts as one LazyFrame (columns missing from a part are nulls): lazily on the local disk;
    read whole from a remote store (polars cannot reach it through our Location)."""
    if all(p.local_path() is not None for p in paths):
        return scan_parquet_union([p.path for p in paths])
    tables = read_tables(paths, None)
    frame = pl.from_arrow(pa.concat_tables(tables, promote_options="permissive"))
    assert isinstance(frame, pl.DataFrame)
    return frame.lazy()


def read_columns(paths: list[Location], columns: list[str]) -> pa.Table | None:
    """The given columns of Parquet files, concatenated in order (None for no files)."""
    tables = read_tables(paths, columns)
    return pa.concat_tables(tables, promote_options="permissive") if tables else None


def read_metadata(loc: Location) -> Any:
    with loc.open_input_file() as fh:
        return pq.read_metadata(fh)


@dataclass(frozen=True)
class PartInfo:
    name: str
    rows: int
    errors: int


@dataclass
class Manifest:
    """The manifest of one output folder (loaded, changed, saved atomically by its owner).

    folder: the output folder (a Location, or a path/URI turned into one); the manifest file itself is
    layout.manifest_path(folder).
    """

    folder: Location
    fingerprint: str = ""
    components: dict[str, str] = field(default_factory=dict)
    id_column: str = ""
    parts: list[PartInfo] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.folder = layout.output_dir(self.folder)

    @property
    def path(self) -> Location:
        return layout.manifest_path(self.folder)

    @classmethod
    def load(cls, folder: "str | os.PathLike[str] | Location") -> "Manifest | None":
        """The folder's manifest (the new place, else an older version's `_manifest.json`); None if none."""
        folder = layout.output_dir(folder)
        p = layout.manifest_path(folder)
        if not p.exists():
            p = layout.legacy_manifest_path(folder)
            if not p.exists():
                return None
        try:
            d = json.loads(p.read_text())
            parts = [PartInfo(x["name"], int(x["rows"]), int(x.get("errors", 0))) for x in d["parts"]]
            return cls(folder, d["fingerprint"], d.get("components", {}), d.get("id_column", ""), parts)
        except (OSError, ValueError, KeyError, TypeError) as e:
            from batchinfer.job.spec import JobError

            raise JobError(f"{p}: manifest is unreadable ({e}); remove the folder or run with --overwrite") from None

    def save(self) -> None:
        data = {
            "version": 1,
            "fingerprint": self.fingerprint,
            "components": self.components,
            "id_column": self.id_column,
            "output": str(self.folder),
            "rows": sum(p.rows for p in self.parts),
            "errors": sum(p.errors for p in self.parts),
            "parts": [{"name": p.name, "rows": p.rows, "errors": p.errors} for p in self.parts],
        }
        self.path.parent.makedirs()
        self.path.write_text(json.dumps(data, indent=1) + "\n")

    def add_part(self, part: PartInfo) -> None:
        self.parts.append(part)
        self.save()

    @property
    def part_locations(self) -> list[Location]:
        return [self.folder / p.name for p in self.parts]

    @property
    def part_paths(self) -> list[str]:
        """The recorded parts as path / URI strings (part_locations for reading them on any store)."""
        return [str(p) for p in self.part_locations]

    def finished_ids(self) -> pl.Series:
        """Canonical keys (batchinfer.io.id_key) of the ids in the recorded parts: the truth for resume.

        Read part by part: parts may hold the id in different types (an output whose id type widened)."""
        from batchinfer.io.id_key import array_keys

        tables = read_tables(self.part_locations, [self.id_column])
        keys = [array_keys(t.column(self.id_column)) for t in tables]
        if not keys:
            return pl.Series("id", [], dtype=pl.Utf8)
        return pl.Series("id", pl.from_arrow(pa.chunked_array(keys, pa.string())), dtype=pl.Utf8).drop_nulls()


def part_files(folder: "str | os.PathLike[str] | Location") -> list[str]:
    return layout.part_names(folder)


def next_part_number(folder: "str | os.PathLike[str] | Location") -> int:
    nums = [int(PART_RE.match(n).group(1)) for n in part_files(folder)]  # type: ignore[union-attr]
    return max(nums, default=-1) + 1


def has_output(folder: "str | os.PathLike[str] | Location") -> bool:
    return layout.manifest_path(folder).exists() or layout.legacy_manifest_path(folder).exists() or bool(part_files(folder))


def clear_output(folder: "str | os.PathLike[str] | Location") -> None:
    """--overwrite: remove our files (parts, manifest, rejects, temps); leave anything else alone."""
    out = layout.output_dir(folder)
    for name in part_files(out):
        (out / name).delete()
    for p in (layout.manifest_path(out), layout.rejects_path(out), *layout.openai_paths(out), layout.legacy_manifest_path(out), out / "_rejects.jsonl"):
        p.delete()
    remove_temp_files(out)
    if out.local_path() is not None and out.is_dir():
        fsync_dir(out.path)


def remove_temp_files(folder: "str | os.PathLike[str] | Location") -> int:
    """Delete what unfinished writes left: the records folder's tmp/ and an older version's temps."""
    out = layout.output_dir(folder)
    n = 0
    for f in layout.tmp_dir(out).files():
        f.delete()
        n += 1
    for name in out.names():
        if layout.is_legacy_temp(name):
            (out / name).delete()
            n += 1
    return n


def recover(manifest: Manifest) -> tuple[int, int]:
    """Add committed-but-unrecorded parts carrying our fingerprint; delete unreadable ones.

    Returns (recovered, deleted). A readable part of another job is never deleted: JobError.
    The caller saves the manifest.
    """
    known = {p.name for p in manifest.parts}
    present = part_files(manifest.folder)
    recovered = deleted = 0
    for name in present:
        if name in known:
            continue
        path = manifest.folder / name
        try:
            meta = read_metadata(path)
            fp = (meta.metadata or {}).get(FINGERPRINT_KEY, b"").decode()
            errors = None
            if fp == manifest.fingerprint:
                t = read_columns([path], ["error"])
                errors = meta.num_rows - (t.column("error").null_count if t is not None else meta.num_rows)
        except Exception as e:  # unreadable: the commit protocol means it was never a complete part of ours
            log.warning("deleting unreadable part %s: %s", path, e)
            path.delete()
            deleted += 1
            continue
        if errors is None:
            from batchinfer.job.spec import JobError

            raise JobError(f"{path} is not output of this job (different fingerprint); use --overwrite or a new output.path")
        manifest.parts.append(PartInfo(name, meta.num_rows, errors))
        recovered += 1
    on_disk = set(present)
    missing = [p for p in manifest.parts if p.name not in on_disk]
    for p in missing:
        log.warning("part %s is in the manifest but missing; its rows will be done again", p.name)
    manifest.parts = sorted((p for p in manifest.parts if p not in missing), key=lambda p: p.name)
    if deleted and manifest.folder.local_path() is not None:
        fsync_dir(manifest.folder.path)
    return recovered, deleted


def lock_output(folder: "str | os.PathLike[str] | Location"):
    """Hold an exclusive lock on the output folder for one run (two runs would write the same rows).

    Local disk: released when the returned object is closed or the process dies (even by kill -9).
    Object stores: a lease object (see store.Lease), released by close(), stale after a dead run.
    """
    out = layout.output_dir(folder)
    layout.records_dir(out).makedirs()
    try:
        return layout.lock_path(out).lock(str(out))
    except LockedError as e:
        from batchinfer.job.spec import JobError

        raise JobError(str(e)) from None
