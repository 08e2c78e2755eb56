"""The report page drawn by a process of its own, after `batchinfer run` has exited.

`batchinfer run` writes `report.json` before it exits (what schedulers and tools read), and leaves
`report.html` to `python -m batchinfer.observe.page_writer OUT_DIR`, started detached (its own session,
no terminal): the plots are most of the report's time (0.6 s on the H200 host for a 1,000-row run, and
importing matplotlib a second more, which a thread of the run used to do while the model loaded), so the
exit code no longer waits for them. The page is the one the run would have drawn: it is rendered from
`report.json` and the run's records (the same inputs, through JSON; tests compare the two pages).

If drawing fails, the page says why and how to draw it again (`batchinfer report OUT_DIR`). A run whose
machine goes away at its exit (a container whose main process ended) may leave no page: `batchinfer run
--wait-for-report` draws it before exiting.
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
from typing import Any

from batchinfer.io import layout


def write_page(out_dir: Any) -> None:
    """Draw `report.html` from `report.json` and the records of out_dir's run; on failure, a page that says so."""
    from batchinfer.observe.report import load_records, write_report_page

    out = layout.output_dir(out_dir)
    try:
        report = json.loads(layout.report_json_path(out).read_text())
        steps, rows, _ = load_records(out)
        write_report_page(out, report, steps, rows)
    except Exception as e:  # noqa: BLE001 (nobody waits on this process: the page itself says what failed)
        note = f"The report page could not be drawn: {type(e).__name__}: {e}. Run `batchinfer report {out}` to draw it again."
        layout.report_html_path(out).write_text(f"<!doctype html><meta charset=utf-8><p>{html.escape(note)}</p>\n")
        raise


def start_detached(out_dir: Any) -> subprocess.Popen:
    """Start `python -m batchinfer.observe.page_writer OUT_DIR` in a session of its own (a Ctrl-C or a
    scheduler's signal to the run's process group does not reach it), output discarded."""
    out = layout.output_dir(out_dir)
    return subprocess.Popen(
        [sys.executable, "-m", "batchinfer.observe.page_writer", out.uri],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m batchinfer.observe.page_writer OUT_DIR", file=sys.stderr)
        return 2
    try:
        write_page(argv[0])
    except Exception as e:  # noqa: BLE001
        print(f"page_writer: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
