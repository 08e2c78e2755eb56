"""Where a job's files live, given its output folder: the one module that knows the names.

The output folder holds the committed `part-NNNNNN.parquet` files. Beside them a run keeps its
bookkeeping and records:
  manifest       `_manifest.json`   the committed parts and the job's fingerprint (io/manifest.py)
  rejects        `_rejects.jsonl`   input lines with no usable id
  steps, rows    `_steps/`, `_rows/`  per engine step / per finished row (observe/records.py)
  token ids      `_token_ids/`      `--log-token-ids` sidecar (observe/tokenlog.py)
  report         `_report.json`, `_report.html`  (observe/report.py)
  openai         `results.jsonl`, `errors.jsonl`  output.format openai (io/openai_batch.py)

Callers ask these functions for a path and never join the names themselves, so moving the records
elsewhere (a hidden sibling folder, say) is a change to this file alone.
"""

from __future__ import annotations

from pathlib import Path

MANIFEST = "_manifest.json"
REJECTS = "_rejects.jsonl"
STEPS_DIR = "_steps"
ROWS_DIR = "_rows"
TOKEN_IDS_DIR = "_token_ids"
REPORT_JSON = "_report.json"
REPORT_HTML = "_report.html"
OPENAI_RESULTS = "results.jsonl"
OPENAI_ERRORS = "errors.jsonl"


def records_dir(out: str | Path) -> Path:
    """The folder that holds the run records of the output folder `out` (today: `out` itself)."""
    return Path(out)


def manifest_path(out: str | Path) -> Path:
    return records_dir(out) / MANIFEST


def rejects_path(out: str | Path) -> Path:
    return records_dir(out) / REJECTS


def steps_dir(out: str | Path) -> Path:
    return records_dir(out) / STEPS_DIR


def rows_dir(out: str | Path) -> Path:
    return records_dir(out) / ROWS_DIR


def token_ids_dir(out: str | Path) -> Path:
    return records_dir(out) / TOKEN_IDS_DIR


def report_json_path(out: str | Path) -> Path:
    return records_dir(out) / REPORT_JSON


def report_html_path(out: str | Path) -> Path:
    return records_dir(out) / REPORT_HTML


def openai_paths(out: str | Path) -> tuple[Path, Path]:
    """results.jsonl and errors.jsonl of `output.format: openai`."""
    return records_dir(out) / OPENAI_RESULTS, records_dir(out) / OPENAI_ERRORS


def observer_folders(out: str | Path) -> tuple[Path, ...]:
    """The record folders an Observer writes (removed when a fresh job starts in `out`)."""
    return steps_dir(out), rows_dir(out), token_ids_dir(out)


def observer_files(out: str | Path) -> tuple[Path, ...]:
    """The single files an Observer writes (the report)."""
    return report_json_path(out), report_html_path(out)
