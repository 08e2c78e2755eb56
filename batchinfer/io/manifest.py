"""The output folder's manifest: which part files are committed, and the job's fingerprint.

Commit protocol (exactly once across kill -9 at any moment):
  1. a part is written as `_tmp.part-N.parquet.tmp`, fsynced, then os.replace'd to `part-N.parquet`
     (the folder is fsynced too); the part carries the job fingerprint in its Parquet metadata;
  2. the manifest (`_manifest.json`) is rewritten atomically (temp file, fsync, os.replace) with the
     part added.
A kill between 1 and 2 leaves a committed-but-unrecorded part. On start we RECOVER it: a complete
`part-*.parquet` (it can only exist complete, because of the rename) with our fingerprint is added to
the manifest; an unreadable one is deleted; one of another fingerprint stops the run (never deleted
without --overwrite). A recovered part's rows were pending
when it was written, so they are in no other part: recovering it never duplicates a row. Stray temp
files (`_tmp.*`, `.*.tmp`) are deleted. Finished ids come from the recorded parts, compared by their
canonical key (id_key.py) whatever type each part holds them in.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from batchinfer.io.layout import MANIFEST, OPENAI_ERRORS, OPENAI_RESULTS, REJECTS, manifest_path  # noqa: F401  (names re-exported)

log = logging.getLogger(__name__)

LOCK = "_lock"
TMP_PREFIX = "_tmp."
PART_RE = re.compile(r"^part-(\d{6})\.parquet$")
FINGERPRINT_KEY = b"batchinfer.fingerprint"


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Write `text` to `path` so that readers see the old or the new file, never a torn one."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fingerprint_of(components: dict[str, Any]) -> str:
    """A stable hash of the things that change outputs (model, prompt, sampling, schema, columns)."""
    text = json.dumps(components, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def component_hashes(components: dict[str, Any]) -> dict[str, str]:
    return {k: fingerprint_of({k: v}) for k, v in sorted(components.items())}


@dataclass(frozen=True)
class PartInfo:
    name: str
    rows: int
    errors: int


@dataclass
class Manifest:
    """The manifest of one output folder (loaded, changed, saved atomically by its owner)."""

    folder: Path
    fingerprint: str = ""
    components: dict[str, str] = field(default_factory=dict)
    id_column: str = ""
    parts: list[PartInfo] = field(default_factory=list)

    @property
    def path(self) -> Path:
        return manifest_path(self.folder)

    @classmethod
    def load(cls, folder: Path) -> "Manifest | None":
        p = manifest_path(folder)
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
            "rows": sum(p.rows for p in self.parts),
            "errors": sum(p.errors for p in self.parts),
            "parts": [{"name": p.name, "rows": p.rows, "errors": p.errors} for p in self.parts],
        }
        atomic_write_text(self.path, json.dumps(data, indent=1) + "\n")

    def add_part(self, part: PartInfo) -> None:
        self.parts.append(part)
        self.save()

    @property
    def part_paths(self) -> list[str]:
        return [str(self.folder / p.name) for p in self.parts]

    def finished_ids(self) -> pl.Series:
        """Canonical keys (batchinfer.io.id_key) of the ids in the recorded parts: the truth for resume.

        Read part by part: parts may hold the id in different types (an output whose id type widened)."""
        from batchinfer.io.id_key import array_keys

        keys = [array_keys(pq.read_table(str(self.folder / p.name), columns=[self.id_column]).column(self.id_column))
                for p in self.parts]
        if not keys:
            return pl.Series("id", [], dtype=pl.Utf8)
        return pl.Series("id", pl.from_arrow(pa.chunked_array(keys, pa.string())), dtype=pl.Utf8).drop_nulls()


def part_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if PART_RE.match(p.name)) if folder.is_dir() else []


def next_part_number(folder: Path) -> int:
    nums = [int(PART_RE.match(n).group(1)) for n in part_files(folder)]  # type: ignore[union-attr]
    return max(nums, default=-1) + 1


def has_output(folder: Path) -> bool:
    return manifest_path(folder).exists() or bool(part_files(folder))


def clear_output(folder: Path) -> None:
    """--overwrite: remove our files (parts, manifest, rejects, OpenAI-shaped results, temps); leave anything else alone."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        if p.is_file() and (PART_RE.match(p.name) or p.name in (MANIFEST, REJECTS, OPENAI_RESULTS, OPENAI_ERRORS) or _is_temp(p.name)):
            p.unlink()
    fsync_dir(folder)


def _is_temp(name: str) -> bool:
    return name.startswith(TMP_PREFIX) or (name.startswith(".") and name.endswith(".tmp"))


def remove_temp_files(folder: Path) -> int:
    n = 0
    for p in folder.iterdir():
        if p.is_file() and _is_temp(p.name):
            p.unlink()
            n += 1
    return n


def recover(manifest: Manifest) -> tuple[int, int]:
    """Add committed-but-unrecorded parts carrying our fingerprint; delete unreadable ones.

    Returns (recovered, deleted). A readable part of another job is never deleted: JobError.
    The caller saves the manifest.
    """
    known = {p.name for p in manifest.parts}
    recovered = deleted = 0
    for name in part_files(manifest.folder):
        if name in known:
            continue
        path = manifest.folder / name
        try:
            meta = pq.read_metadata(str(path))
            fp = (meta.metadata or {}).get(FINGERPRINT_KEY, b"").decode()
            errors = None
            if fp == manifest.fingerprint:
                errors = int(pl.scan_parquet(str(path)).select(pl.col("error").is_not_null().sum()).collect().item())
        except Exception as e:  # unreadable: the rename protocol means it was never a complete part of ours
            log.warning("deleting unreadable part %s: %s", path, e)
            path.unlink()
            deleted += 1
            continue
        if errors is None:
            from batchinfer.job.spec import JobError

            raise JobError(f"{path} is not output of this job (different fingerprint); use --overwrite or a new output.path")
        manifest.parts.append(PartInfo(name, meta.num_rows, errors))
        recovered += 1
    missing = [p for p in manifest.parts if not (manifest.folder / p.name).exists()]
    for p in missing:
        log.warning("part %s is in the manifest but missing; its rows will be done again", p.name)
    manifest.parts = sorted((p for p in manifest.parts if p not in missing), key=lambda p: p.name)
    if deleted:
        fsync_dir(manifest.folder)
    return recovered, deleted


def lock_output(folder: Path):
    """Hold an exclusive lock on the output folder for one run (two runs would write the same rows).

    The lock is released when the returned file is closed or the process dies (even by kill -9).
    """
    import fcntl

    fh = open(folder / LOCK, "a+")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.close()
        from batchinfer.job.spec import JobError

        raise JobError(f"another batchinfer run is writing to {folder}; wait for it to finish") from None
    return fh
