"""`_report.html`: the run report a person reads, as one self-contained page (pagekit.py).

Top to bottom: the headline (job, model, device, when and how long, rows ok / errors / rejected,
documents per hour, output tokens/s, roofline), sample answers (a few successful rows and a few of
each error kind, with their input excerpts; the rejects file), what a structured job's answers say
(per field; a plot per enum / boolean field and a histogram per number field), then throughput,
latency, lengths, engine steps and KV cache, the output check, and the resolved job, run facts and
versions (collapsed). Every number has a label in words and a unit.

Reads only the report dict (report.py) and the step / row frames; imports nothing that imports it.
"""

from __future__ import annotations

import os
from typing import Any

import polars as pl

from batchinfer.io import layout
from batchinfer.observe import labels as L
from batchinfer.observe import plots
from batchinfer.observe.pagekit import details, document, esc, facts, grid, img, kv_table

MAX_FIELD_PLOTS = 24


# ------------------------------------------------------------------------------------------ headline


def roofline_text(r: dict[str, Any]) -> tuple[str, str]:
    if "fraction" not in r:
        return "not computed", str(r.get("note", ""))
    return L.pct(r["fraction"]), (
        f"{r['bound']}-bound floor {L.seconds(r['floor_s'])} vs the engine's time; on {r['basis']}"
    )


def headline(report: dict[str, Any]) -> str:
    h, t, m, d, tp = report["headline"], report["times"], report["model"], report["device"], report["throughput"]
    name, model_small = L.model_text(m)
    roof, roof_small = roofline_text(h["roofline"])
    runs = len(t.get("runs") or [])
    items = [
        ("model", "Model", name, model_small + (f" ({m['note']})" if m.get("note") else "")),
        ("device", "Device", L.device_text(d), str(d.get("platform") or "") if d.get("kind") == "cpu" else ""),
        ("start", "Started", L.clock(t.get("start")), ""),
        ("end", "Finished", L.clock(t.get("end")), ""),
        ("wall", "Wall time", L.seconds(h["wall_s"]),
         f"over {runs} runs (time between runs not counted)" if runs > 1 else "from start to the last row, model load included"),
        ("rows", "Rows", f"{L.count(h['rows_ok'])} ok \u00b7 {L.plural(h['rows_error'], 'error')} \u00b7 "
                         f"{L.count(h['rows_rejected'])} rejected",
         f"{L.pct(h['rows_error'] / h['rows']) if h['rows'] else L.DASH} of rows have an error"),
        ("docs-per-hour", "Documents per hour", L.num(h["documents_per_hour"]), "rows over the wall time"),
        ("output-tps", "Output tokens/s", L.num(h["output_tokens_per_s"]),
         f"while generating ({L.seconds(tp['engine_s'])} of engine time)"),
        ("roofline", "Roofline", roof, roof_small),
    ]
    job = report.get("job") or {}
    sub = [f"output {report['out_dir']}"]
    if job.get("input"):
        sub.append(f"input {job['input']}")
    sub.append(f"report generated {report['generated_at'].replace('T', ' ').replace('Z', ' UTC')}")
    dot = " \u00b7 "
    return (
        f"<h1>{esc(job.get('name') or 'batchinfer run')}</h1>"
        f'<p class="sub">batchinfer run report{dot}{dot.join(esc(s) for s in sub)}</p>'
        + facts(items)
    )


# ------------------------------------------------------------------------------------ sample answers


def samples(report: dict[str, Any]) -> str:
    s = report.get("samples") or {}
    if "note" in s:
        return f'<h2 id="samples">Sample answers</h2><p class="note">{esc(s["note"])}</p>'
    parts = ['<h2 id="samples">Sample answers</h2>']
    ok = s.get("ok") or []
    if ok:
        rows = [[r["id"], r.get("excerpt") or L.DASH, r["answer"], f"{L.count(r['completion_tokens'])} tokens, "
                 + str(L.FINISH_LABELS.get(r["finish_reason"], r["finish_reason"] or L.DASH))] for r in ok]
        parts.append(grid(["Row", "Input (excerpt)", "Answer", "Output"], rows, text=(1, 2), id_="samples-ok"))
    else:
        parts.append('<p class="note">no successful row in the output</p>')
    for kind, e in (s.get("errors") or {}).items():
        parts.append(f"<h3>Error: {esc(kind)} ({L.plural(e['count'], 'row')})</h3>")
        rows = [[r["id"], r.get("excerpt") or L.DASH, r["error"]] for r in e["rows"]]
        parts.append(grid(["Row", "Input (excerpt)", "Error"], rows, text=(1, 2)))
    rej = s.get("rejects")
    if rej and rej["count"]:
        rejects, page = layout.rejects_path(report["out_dir"]), layout.report_html_path(report["out_dir"])
        href = os.path.relpath(rejects.path, page.parent.path) if rejects.local_path() is not None else rejects.uri
        parts.append(
            f"<h3>Rejected input lines ({L.count(rej['count'])})</h3><p>Lines with no usable id never became rows; "
            f'all of them are in <a id="rejects-link" href="{esc(href)}">{esc(href)}</a>.</p>'
        )
        rows = [[f"{x.get('file', '')} line {x.get('line', '?')}", x.get("reason") or "", x.get("text", "")] for x in rej["examples"]]
        parts.append(grid(["Where", "Why", "Line"], rows, text=(2,)))
    return "".join(parts)


# ------------------------------------------------------------------------------------ answer fields


def _field_summary(f: dict[str, Any]) -> str:
    answered = f["n"] - f["nulls"]
    if "counts" in f:
        return ", ".join(f"{_value(k)} {L.pct(c / answered) if answered else L.DASH}" for k, c in f["counts"][:8])
    if "hist" in f:
        return f"min {L.num(f['min'])}, median {L.num(f['p50'])}, mean {L.num(f['mean'])}, max {L.num(f['max'])}"
    if "top" in f:
        top = ", ".join(f"\u201c{k}\u201d {L.pct(c / answered) if answered else L.DASH}" for k, c in f["top"][:3])
        lens = f["lengths"]
        return f"{L.count(f['distinct'])} distinct; top: {top}; length {lens['min']}\u2013{lens['max']} characters"
    if "lengths" in f:
        lens = f["lengths"]
        return f"length {lens['min']}\u2013{lens['max']} items (median {L.num(lens['p50'])})"
    return L.DASH


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


KIND_LABELS = {"enum": "one of a list", "boolean": "true / false", "integer": "integer", "number": "number",
               "string": "text", "array": "list", "json": "JSON value"}


def answer_fields(report: dict[str, Any]) -> str:
    a = report.get("answers")
    if not a:
        return ""
    fields = a["fields"]
    head = ('<h2 id="answers">What the answers say</h2>'
            f"<p>{L.count(a['rows'])} answers without an error; one line per field of the "
            + ("schema" if a["schema_known"] else "answers (the job's schema could not be read: kinds from the column types)")
            + ".</p>")
    rows = [[f["path"], KIND_LABELS.get(f["kind"], f["kind"]), L.pct(f["null_share"]), _field_summary(f)] for f in fields]
    table = grid(["Field", "Kind", "Null", "What the answers say"], rows, numeric=(2,), id_="answer-fields")
    figs = []
    for f in fields:
        if len(figs) >= MAX_FIELD_PLOTS:
            break
        answered = f["n"] - f["nulls"]
        if "counts" in f:
            fig = plots.value_counts(f["path"], [(_value(k), c) for k, c in f["counts"]], answered)
            figs.append(img(f"field-{f['path']}", f"answers of {f['path']}", fig))
        elif "hist" in f:
            h = f["hist"]
            fig = plots.histogram(f["path"], h["edges"], h["counts"], f["kind"] == "integer")
            figs.append(img(f"field-{f['path']}", f"histogram of {f['path']}", fig))
    more = len([f for f in fields if "counts" in f or "hist" in f]) - len(figs)
    note = f'<p class="note">{more} more field plots left out</p>' if more > 0 else ""
    return head + table + f'<div class="plots">{"".join(figs)}</div>' + note


# --------------------------------------------------------------------------------------- the numbers


def _dist_table(dists: dict[str, dict[str, Any]], names: dict[str, str], fmt: Any) -> str:
    head = ["", *[h for _, h in L.DIST_HEADS]]
    rows = []
    for key, d in dists.items():
        if not isinstance(d, dict):
            continue
        cells = [L.count(d.get("count"))] + [fmt(d.get(k)) for k, _ in L.DIST_HEADS[1:]]
        rows.append([names.get(key, key), *cells])
    return grid(head, rows, numeric=range(1, len(head)))


def numbers(report: dict[str, Any]) -> list[str]:
    t, tp, kv, h = report["totals"], report["throughput"], report["kv"], report["headline"]
    reasons = [(L.FINISH_LABELS.get(k, k).capitalize(), f"{L.count(v)} ({L.pct(v / t['rows']) if t['rows'] else L.DASH})")
               for k, v in t["finish_reasons"].items()]
    rows_table = kv_table([
        ("Rows", L.count(t["rows"])), ("Succeeded", L.count(t["ok"])), ("With an error", L.count(t["errors"])),
        *reasons,
        ("Prompt tokens", L.count(t["prompt_tokens"])), ("Output tokens", L.count(t["completion_tokens"])),
        ("Runs (first run and resumes)", L.count(t["runs"])),
    ], "totals")
    throughput_table = kv_table([
        ("Engine time (first step to last, summed over runs)", L.seconds(tp["engine_s"])),
        ("Documents per hour (wall time)", L.num(h["documents_per_hour"])),
        ("Rows per second (engine time)", L.num(tp["rows_per_s"])),
        ("Rows per hour (engine time)", L.num(tp["rows_per_hour"])),
        ("Prompt tokens per second", L.num(tp["prompt_tokens_per_s"])),
        ("Output tokens per second", L.num(tp["completion_tokens_per_s"])),
        ("All tokens per second", L.num(tp["total_tokens_per_s"])),
    ], "throughput")
    steps = {k: v for k, v in report["step_ms"].items() if isinstance(v, dict)}
    kv_rows = [("KV cache blocks", L.count(kv.get("total_blocks")))]
    if kv.get("total_blocks"):
        kv_rows += [
            ("Most blocks in use", f"{L.count(kv['peak_used'])} ({L.pct(kv['peak_used_frac'])})"),
            ("Mean share of blocks in use", L.pct(kv["mean_used_frac"])),
            ("Most sequences running at once", L.count(kv.get("peak_running"))),
            ("Most sequences waiting", L.count(kv.get("peak_waiting"))),
        ]
    kv_rows += [("Engine steps", L.count(t["steps"])), ("Preemptions", L.count(t["step_preemptions"])),
                ("Share of step time spent scheduling (CPU)", L.pct(report["step_ms"].get("schedule_share")))]
    return [
        "<h2>Rows</h2>" + rows_table,
        "<h2>Throughput</h2>" + throughput_table,
        "<h2>Latency</h2>" + _dist_table(report["latency_s"], L.LATENCY_LABELS, L.seconds)
        + '<p class="note">rows that reached the engine; seconds from a row\'s arrival in the engine</p>',
        "<h2>Lengths (tokens)</h2>" + _dist_table(report["lengths"], L.LENGTH_LABELS, lambda x: L.num(x)),
        "<h2>Engine steps and KV cache</h2>" + _dist_table(steps, L.STEP_LABELS, L.milliseconds) + kv_table(kv_rows, "kv"),
    ]


def output_check(report: dict[str, Any]) -> str:
    out = report.get("output")
    if out is None:
        return ""
    cls = "" if out["matches_records"] else ' class="bad"'
    table = kv_table([
        ("Part files", L.count(out["parts"])), ("Rows in the output", L.count(out["rows"])),
        ("Rows with an error", L.count(out["errors"])), ("Rejected input lines", L.count(out.get("rejects", 0))),
        ("Rows without a run record", L.count(out["rows_without_record"])),
        ("Run records match the output", "yes" if out["matches_records"] else "no"),
    ])
    return f"<h2>Output check</h2><div{cls}>{table}</div>"


def errors_table(report: dict[str, Any]) -> str:
    errs = report["errors_by_kind"]
    if not errs:
        return "<h2>Errors by kind</h2><p>none</p>"
    rows = [[k, L.count(e["count"]), str(e["example_id"]), e["example"]] for k, e in errs.items()]
    return "<h2>Errors by kind</h2>" + grid(["Kind", "Rows", "e.g. row", "Message"], rows, numeric=(1,), text=(3,))


# ------------------------------------------------------------------------------------------- page


def render_html(report: dict[str, Any], steps: pl.DataFrame, rows: pl.DataFrame) -> str:
    """The whole page as one string."""
    nums = numbers(report)
    body = [
        headline(report),
        samples(report),
        answer_fields(report),
        nums[1], img("throughput", "throughput over time", plots.throughput(steps, rows)),
        nums[2], img("latency", "latency percentiles", plots.latency(report)),
        nums[3], img("lengths", "prompt and output lengths", plots.lengths(rows)),
        nums[4], img("occupancy", "sequences and KV cache use", plots.occupancy(steps)),
        img("step-times", "engine step time", plots.step_times(steps)),
        nums[0],
        errors_table(report),
        output_check(report),
        "<h2>Details</h2>",
        f"<p>Job fingerprint <code>{esc(report.get('fingerprint'))}</code></p>",
        details("The job (resolved)", report.get("config")),
        details("This run (driver summary)", report.get("run")),
        details("Model", report.get("model")),
        details("Package versions", report.get("versions")),
    ]
    return document(f"batchinfer report: {(report.get('job') or {}).get('name', '')}", "\n".join(body))
