"""Where a job's files are. The output folder holds the output and nothing else, so every Parquet
reader given the folder (pyarrow, polars, DuckDB, pandas, Spark) gets exactly the output rows; the
run's records live in a sibling folder, found from the output path alone:

    <parent>/<name>/                   part-000000.parquet, part-000001.parquet, ...   (only these)
    <parent>/_<name>.batchinfer/       the run records:
        manifest.json                  committed parts and the job's fingerprint (the truth for resume)
        rejects.jsonl                  input lines that could not become output rows
        lock                           one run at a time (local: flock; object store: a lease object)
        tmp/                           parts being written (local disk), renamed into <name>/ when whole
        rows/ steps/ token_ids/        per-row and per-step records, token ids (--log-token-ids)
        report.json report.html        the end-of-run report
        results.jsonl errors.jsonl     the OpenAI Batch output files (output.format: openai)

The leading `_` keeps the records out of readers of the PARENT folder too where they skip `_` names
(pyarrow, pandas, Spark; hive-partitioned outputs such as `out/date=2024-01-02/` stay readable as one
dataset). Every module asks this one for a path; none builds record paths itself.

Older versions kept the records inside the output folder (`_manifest.json`, `_rows/`, ...).
`migrate_legacy` moves them here (manifest last, so a kill mid-way leaves a folder that migrates again);
`Manifest.load` also reads a legacy manifest that was not migrated yet.
"""

from __future__ import annotations

import logging
import os
import re

from batchinfer.io.store import Location, StoreError, location

log = logging.getLogger(__name__)

RECORDS_SUFFIX = ".batchinfer"
PART_RE = re.compile(r"^part-(\d{6})\.parquet$")

# names inside the records folder
MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"
LOCK = "lock"
TMP = "tmp"
ROWS = "rows"
STEPS = "steps"
TOKEN_IDS = "token_ids"
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
OPENAI_RESULTS = "results.jsonl"
OPENAI_ERRORS = "errors.jsonl"
STEPS_DIR, ROWS_DIR, TOKEN_IDS_DIR = STEPS, ROWS, TOKEN_IDS  # (older names)

# the layout of older versions: name inside the output folder -> name inside the records folder
LEGACY = {
    "_rows": ROWS, "_steps": STEPS, "_token_ids": TOKEN_IDS, "_report.json": REPORT_JSON, "_report.html": REPORT_HTML,
    OPENAI_RESULTS: OPENAI_RESULTS, OPENAI_ERRORS: OPENAI_ERRORS,
    "_rejects.jsonl": REJECTS, "_manifest.json": MANIFEST,  # the manifest moves last
}
LEGACY_MANIFEST = "_manifest.json"
LEGACY_LOCK = "_lock"
LEGACY_TMP_PREFIX = "_tmp."


def output_dir(path: "str | os.PathLike[str] | Location") -> Location:
    """The output folder of `output.path` (a local path or a URI); refuses a root with no parent to sit beside."""
    out = location(path)
    if not out.name or out.parent.uri.rstrip("/") == out.uri.rstrip("/"):
        raise StoreError(f"output.path {out}: give a folder below a root or bucket (its run records go beside it)")
    return out


def records_dir(out: "str | os.PathLike[str] | Location") -> Location:
    """`<parent>/_<name>.batchinfer/`: the run records of the output folder `out`."""
    out = output_dir(out)
    return out.parent / f"_{out.name}{RECORDS_SUFFIX}"


def manifest_path(out: "str | Location") -> Location:
    return records_dir(out) / MANIFEST


def rejects_path(out: "str | Location") -> Location:
    return records_dir(out) / REJECTS


def lock_path(out: "str | Location") -> Location:
    return records_dir(out) / LOCK


def tmp_dir(out: "str | Location") -> Location:
    return records_dir(out) / TMP


def rows_dir(out: "str | Location") -> Location:
    return records_dir(out) / ROWS


def steps_dir(out: "str | Location") -> Location:
    return records_dir(out) / STEPS


def token_ids_dir(out: "str | Location") -> Location:
    return records_dir(out) / TOKEN_IDS


def report_json_path(out: "str | Location") -> Location:
    return records_dir(out) / REPORT_JSON


def report_html_path(out: "str | Location") -> Location:
    return records_dir(out) / REPORT_HTML


def openai_paths(out: "str | Location") -> tuple[Location, Location]:
    """results.jsonl and errors.jsonl of `output.format: openai`."""
    return records_dir(out) / OPENAI_RESULTS, records_dir(out) / OPENAI_ERRORS


def observer_folders(out: "str | Location") -> tuple[Location, ...]:
    """The record folders an Observer writes (removed when a fresh job starts in `out`)."""
    return steps_dir(out), rows_dir(out), token_ids_dir(out)


def observer_files(out: "str | Location") -> tuple[Location, ...]:
    """The single files an Observer writes (the report)."""
    return report_json_path(out), report_html_path(out)


def part_name(number: int) -> str:
    return f"part-{number:06d}.parquet"


def part_names(out: "str | Location") -> list[str]:
    """Names of the committed part files in the output folder, sorted."""
    return [n for n in output_dir(out).names() if PART_RE.match(n)]


def legacy_manifest_path(out: "str | Location") -> Location:
    return output_dir(out) / LEGACY_MANIFEST


def is_legacy_temp(name: str) -> bool:
    """A temp file an older version left inside the output folder."""
    return name.startswith(LEGACY_TMP_PREFIX) or (name.startswith(".") and name.endswith(".tmp"))


def migrate_legacy(out: "str | Location") -> int:
    """Move an older version's records out of the output folder into records_dir (idempotent).

    Call it holding the output's lock. Returns how many entries moved. Record folders are merged file
    by file (a resumed run's records are kept); a manifest already in the new place wins over a legacy
    one (parts missing from it are recovered from the folder anyway).
    """
    out = output_dir(out)
    present = set(out.names())
    legacy_dirs = [n for n in (k for k in LEGACY if not k.endswith((".json", ".jsonl", ".html"))) if (out / n).is_dir()]
    # results.jsonl / errors.jsonl only move when the folder is an older batchinfer output (a manifest)
    legacy_names = set(LEGACY) if LEGACY_MANIFEST in set(out.names()) else set(LEGACY) - {OPENAI_RESULTS, OPENAI_ERRORS}
    legacy_files = [n for n in LEGACY if n in present and n in legacy_names]
    stray = [n for n in present if is_legacy_temp(n) or n == LEGACY_LOCK]
    if not (legacy_dirs or legacy_files or stray):
        return 0
    rec = records_dir(out)
    rec.makedirs()
    moved = 0
    for name in legacy_dirs:
        dst = rec / LEGACY[name]
        dst.makedirs()
        have = set(dst.names())
        for f in (out / name).files():
            if f.name in have:
                f.delete()
            else:
                f.move_to(dst / f.name)
            moved += 1
        (out / name).delete_tree()
    for name in legacy_files:  # LEGACY's order: the manifest last
        src, dst = out / name, rec / LEGACY[name]
        if name == LEGACY_MANIFEST and dst.exists():
            log.warning("%s: a manifest exists in both layouts; keeping %s", out, dst)
            src.delete()
            continue
        src.move_to(dst)
        moved += 1
    for name in stray:
        (out / name).delete()
    log.info("moved the run records of %s out of the output folder into %s", out, rec)
    return moved
