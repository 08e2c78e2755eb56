"""The end-of-run report: `report.json` (numbers) and `report.html` (the page a person reads, page.py).

What the report holds: a headline (job, model, device, start/end/wall time, rows ok/errors/rejected,
documents per hour, output tok/s, roofline fraction: runinfo.py), sample answers and what a
structured job's answers say per field (answers.py), then totals, throughput, latency, lengths,
steps, KV use, errors by kind, the output check, and the run's config, versions and fingerprint.

Both files are rebuilt from what the run left (the step and row records, the manifest, the output
parts; paths from batchinfer/io/layout.py: the records folder beside the output), so `batchinfer report OUT_DIR` can print the summary and redraw the page at any time, also
after a run that died or was resumed. Row records are de-duplicated (last record of an id wins) and,
where the folder has a manifest, kept only for ids the committed output holds: the report's row
totals are then the output's row totals.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import polars as pl

from batchinfer.io import layout
from batchinfer.io.layout import REPORT_HTML, REPORT_JSON  # noqa: F401  (names re-exported)
from batchinfer.io.manifest import Manifest
from batchinfer.io.store import Location
from batchinfer.observe import answers, runinfo
from batchinfer.observe.labels import LATENCY_COLUMNS, PERCENTILES
from batchinfer.observe.records import ROW_SCHEMA, STEP_SCHEMA, error_kind, part_locations, read_parts

log = logging.getLogger(__name__)

VERSION_PACKAGES = (
    "batchinfer", "torch", "transformers", "tokenizers", "safetensors", "triton", "flash-attn", "xgrammar",
    "llguidance", "outlines-core", "pyarrow", "polars", "numpy",
)
# what a rewrite of the report keeps from the previous `_report.json`: facts of the run itself
RUN_FACTS = ("fingerprint", "config", "versions", "model", "schema")


def package_versions() -> dict[str, str]:
    """Versions of Python, the platform and the packages that change results or speed."""
    out = {"python": platform.python_version(), "platform": platform.platform()}
    for name in VERSION_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    try:
        import torch

        out["cuda"] = str(torch.version.cuda)
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name(0)
    except Exception:  # pragma: no cover - torch is a dependency, but a report must never fail on it
        pass
    return out


# ----------------------------------------------------------------------------------------- loading


def _run_offsets(steps: pl.DataFrame, rows: pl.DataFrame) -> pl.DataFrame:
    """Per run: its start (s since its Observer was made) and where it begins on the joined time axis.

    Runs (a first run and its resumes) are laid end to end in run_id order, each from its first step's
    start to its last step or row, so plots over time show one continuous job.
    """
    spans = pl.concat(
        [
            steps.select("run_id", (pl.col("t") - pl.col("step_ms") / 1000.0).alias("a"), pl.col("t").alias("b")),
            rows.select("run_id", pl.col("finished_t").alias("a"), pl.col("finished_t").alias("b")),
        ]
    )
    runs = (
        spans.group_by("run_id")
        .agg(pl.col("a").min().alias("start"), pl.col("b").max().alias("end"))
        .sort("run_id")
        .with_columns((pl.col("end") - pl.col("start")).fill_null(0.0).clip(lower_bound=0.0).alias("duration"))
        .with_columns((pl.col("duration").cum_sum() - pl.col("duration")).alias("offset"))
    )
    return runs.with_columns(pl.col("start").fill_null(0.0))


def load_records(out_dir: "str | Path | Location") -> tuple[pl.DataFrame, pl.DataFrame, Manifest | None]:
    """(steps, rows, manifest) of an output folder; both frames get an `elapsed` column (joined time axis)."""
    out = layout.output_dir(out_dir)
    steps = read_parts(layout.steps_dir(out), STEP_SCHEMA)
    rows = read_parts(layout.rows_dir(out), ROW_SCHEMA)
    steps = steps.unique(subset=["run_id", "step"], keep="last", maintain_order=True)  # see PartSink.compact
    rows = rows.unique(subset="id", keep="last", maintain_order=True)
    manifest = Manifest.load(out)
    if manifest is not None and manifest.parts and manifest.id_column:
        kept = pl.DataFrame({"id": sorted(manifest.finished_ids())}, schema={"id": pl.Utf8})
        dropped = rows.height
        rows = rows.join(kept, on="id", how="semi")
        dropped -= rows.height
        if dropped:
            log.info("report: %d row records are not in the committed output (a run died); left out", dropped)
    runs = _run_offsets(steps, rows).select("run_id", "start", "offset")
    steps = steps.join(runs, on="run_id", how="left").with_columns(
        (pl.col("t") - pl.col("start") + pl.col("offset")).alias("elapsed")
    ).drop("start", "offset").sort("elapsed")
    rows = rows.join(runs, on="run_id", how="left").with_columns(
        (pl.col("finished_t") - pl.col("start") + pl.col("offset")).alias("elapsed")
    ).drop("start", "offset")
    return steps, rows, manifest


# ------------------------------------------------------------------------------------------ numbers


def _dist(frame: pl.DataFrame, column: str) -> dict[str, float | int | None]:
    """count, mean, max and the PERCENTILES of one column (nulls left out)."""
    s = frame.get_column(column).drop_nulls().cast(pl.Float64)
    out: dict[str, float | int | None] = {"count": s.len()}
    if s.len() == 0:
        out.update({"mean": None, "max": None, **{f"p{int(q * 100)}": None for q in PERCENTILES}})
        return out
    out["mean"] = float(s.mean())  # type: ignore[arg-type]
    for q in PERCENTILES:
        out[f"p{int(q * 100)}"] = float(s.quantile(q, interpolation="linear"))  # type: ignore[arg-type]
    out["max"] = float(s.max())  # type: ignore[arg-type]
    return out


def _engine_seconds(steps: pl.DataFrame) -> float:
    """Time the engine ran: per run, first step's start to last step's end, summed over runs."""
    if steps.height == 0:
        return 0.0
    per_run = steps.group_by("run_id").agg(
        (pl.col("t").max() - (pl.col("t") - pl.col("step_ms") / 1000.0).min()).alias("s")
    )
    return float(per_run.get_column("s").sum())


def _speculative(steps: pl.DataFrame) -> dict[str, Any] | None:
    """Speculative decoding totals (None when the run drafted nothing, or its steps predate the columns)."""
    keys = ("drafted", "verified", "accepted", "rows", "decode_rows", "emitted")
    if steps.height == 0 or any(f"spec_{k}" not in steps.columns for k in keys):
        return None
    tot = {k: int(steps.get_column(f"spec_{k}").fill_null(0).sum()) for k in keys}
    if not tot["drafted"]:
        return None
    tot["acceptance"] = tot["accepted"] / tot["verified"] if tot["verified"] else None
    tot["mean_accepted_per_seq_step"] = tot["accepted"] / tot["rows"] if tot["rows"] else None
    tot["tokens_per_seq_per_forward"] = tot["emitted"] / tot["decode_rows"] if tot["decode_rows"] else None
    sources = ("forced", "text")
    if all(f"spec_{s}_{k}" in steps.columns for s in sources for k in ("verified", "accepted")):
        # accepted draft tokens by source: grammar-forced tokens, the forced text's tokens, n-gram
        by = {s: int(steps.get_column(f"spec_{s}_accepted").fill_null(0).sum()) for s in sources}
        tot["accepted_by_source"] = {"grammar_forced": by["forced"], "grammar_text": by["text"],
                                     "ngram": tot["accepted"] - by["forced"] - by["text"]}
    return tot


def compute_report(steps: pl.DataFrame, rows: pl.DataFrame, manifest: Manifest | None) -> dict[str, Any]:
    """The numbers of `_report.json` (everything but the run's own config/fingerprint/versions)."""
    reasons = rows.group_by("finish_reason").len().sort("finish_reason")
    finish = {r: int(n) for r, n in reasons.iter_rows()}
    n_err = int(rows.get_column("failed").sum())  # error set or finish_reason error: as the output counts
    totals = {
        "rows": rows.height,
        "ok": rows.height - n_err,
        "errors": n_err,
        "finish_reasons": finish,
        "prompt_tokens": int(rows.get_column("prompt_tokens").sum()),
        "completion_tokens": int(rows.get_column("completion_tokens").sum()),
        "row_preemptions": int(rows.get_column("num_preemptions").sum()),
        "steps": steps.height,
        "step_preemptions": int(steps.get_column("num_preemptions").sum()),
        "prefill_tokens_processed": int(steps.get_column("num_prefill_tokens").sum()),
        "decode_tokens_processed": int(steps.get_column("num_decode_tokens").sum()),
        "runs": steps.get_column("run_id").unique().len() if steps.height else rows.get_column("run_id").unique().len(),
    }
    secs = _engine_seconds(steps)
    rate = (lambda n: n / secs) if secs > 0 else (lambda n: None)
    ran = rows.filter(pl.col("finish_reason") != "error")  # the engine ran these (errors end at once)
    ok_prompt = int(ran.get_column("prompt_tokens").sum())
    throughput = {
        "engine_s": secs,
        "rows_per_s": rate(totals["rows"]),
        "rows_per_hour": rate(totals["rows"] * 3600),
        "prompt_tokens_per_s": rate(ok_prompt),
        "completion_tokens_per_s": rate(totals["completion_tokens"]),
        "total_tokens_per_s": rate(ok_prompt + totals["completion_tokens"]),
    }
    errs = (
        rows.filter(pl.col("failed"))
        .with_columns(pl.col("error").fill_null("").map_elements(error_kind, return_dtype=pl.Utf8).alias("kind"))
        .group_by("kind")
        .agg(pl.len().alias("n"), pl.col("id").first().alias("example_id"), pl.col("error").first().alias("example"))
        .sort("n", descending=True)
    )
    errors_by_kind = {
        k: {"count": int(n), "example_id": i, "example": (e or "")[:300]} for k, n, i, e in errs.iter_rows()
    }
    kv: dict[str, Any] = {"total_blocks": None, "peak_used": None, "peak_used_frac": None, "mean_used_frac": None}
    if steps.height:
        k = steps.select(
            (pl.col("kv_blocks_used") + pl.col("kv_blocks_free")).max().alias("total"),
            pl.col("kv_blocks_used").max().alias("peak"),
            (pl.col("kv_blocks_used") / (pl.col("kv_blocks_used") + pl.col("kv_blocks_free"))).mean().alias("mean"),
        ).row(0, named=True)
        total = int(k["total"] or 0)
        kv = {
            "total_blocks": total,
            "peak_used": int(k["peak"]),
            "peak_used_frac": (k["peak"] / total) if total else None,
            "mean_used_frac": float(k["mean"]) if k["mean"] is not None else None,
            "peak_running": int(steps.get_column("num_running").max()),  # type: ignore[arg-type]
            "peak_waiting": int(steps.get_column("num_waiting").max()),  # type: ignore[arg-type]
        }
    spec = _speculative(steps)
    step_ms = {"step": _dist(steps, "step_ms"), "schedule": _dist(steps, "schedule_ms")}
    total_step = float(steps.get_column("step_ms").sum()) if steps.height else 0.0
    step_ms["schedule_share"] = (float(steps.get_column("schedule_ms").sum()) / total_step) if total_step else None  # type: ignore[assignment]
    output = None
    if manifest is not None:
        out_rows = sum(p.rows for p in manifest.parts)
        out_errors = sum(p.errors for p in manifest.parts)
        output = {
            "parts": len(manifest.parts),
            "rows": out_rows,
            "errors": out_errors,
            "rows_without_record": out_rows - rows.height,
            "matches_records": out_rows == rows.height and out_errors == n_err,
        }
        rejects = layout.rejects_path(manifest.folder)
        if rejects.exists():
            output["rejects"] = sum(1 for line in rejects.read_bytes().splitlines() if line.strip())
    return {
        "totals": totals,
        "throughput": throughput,
        "latency_s": {name: _dist(ran, col) for name, col in LATENCY_COLUMNS.items()},
        "lengths": {"prompt_tokens": _dist(rows, "prompt_tokens"), "completion_tokens": _dist(rows, "completion_tokens")},
        "step_ms": step_ms,
        "errors_by_kind": errors_by_kind,
        "kv": kv,
        "speculative": spec,
        "output": output,
    }


# ------------------------------------------------------------------------------------------ writing


def _answers_sections(out: Location, config: dict[str, Any] | None, schema: dict[str, Any] | None,
                      manifest: Manifest | None, rows: pl.DataFrame) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(samples, answers): a few example rows, and what a structured job's answers say per field."""
    lf = answers.output_frame(manifest)
    samples = answers.sample_answers(lf, rows)
    samples["rejects"] = answers.reject_samples(layout.rejects_path(out))
    structured = runinfo.section(config, "structured")
    if lf is None or not structured:
        return samples, None
    table = answers.answer_columns(lf, structured, schema)
    if table is None:
        return samples, None
    specs = answers.answer_specs(table, schema, structured)
    return samples, {"rows": table.height, "schema_known": schema is not None, "fields": answers.field_stats(table, specs)}


def _headline(report: dict[str, Any], rows: pl.DataFrame) -> dict[str, Any]:
    """The numbers the page opens with (the facts they come from are beside them in the report)."""
    t, tp, out, kv = report["totals"], report["throughput"], report.get("output") or {}, report["kv"]
    wall = report["times"]["wall_s"]
    engine = runinfo.section(report.get("config"), "engine")
    return {
        "rows": t["rows"],
        "rows_ok": t["ok"],
        "rows_error": t["errors"],
        "rows_rejected": out.get("rejects", 0),
        "wall_s": wall,
        "documents_per_hour": t["rows"] * 3600 / wall if wall else None,
        "output_tokens_per_s": tp["completion_tokens_per_s"],
        "roofline": runinfo.roofline_facts(rows, report["model"], report["device"], tp["engine_s"],
                                           kv.get("total_blocks"), int(engine.get("block_size") or 16)),
    }


def build_report(out_dir: "str | Path | Location", run: dict[str, Any] | None = None) -> tuple[dict[str, Any], pl.DataFrame, pl.DataFrame]:
    """(report dict, steps, rows). `run`: what the driver knows (config, fingerprint, ...), kept as is;
    the RUN_FACTS keys in it are the facts a previous report recorded (see previous_facts)."""
    out = layout.output_dir(out_dir)
    steps, rows, manifest = load_records(out)
    report: dict[str, Any] = {"version": 2, "out_dir": out.uri, "records_dir": layout.records_dir(out).uri, "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    run = dict(run or {})
    report["fingerprint"] = run.pop("fingerprint", None) or (manifest.fingerprint if manifest else None)
    config = report["config"] = run.pop("config", None)
    report["versions"] = run.pop("versions", None) or package_versions()
    stored_model, stored_schema = run.pop("model", None), run.pop("schema", None)
    report["run"] = run
    structured = runinfo.section(config, "structured")
    report["job"] = {
        "name": out.name,
        "input": runinfo.section(config, "input").get("path"),
        "template": runinfo.section(config, "prompt").get("template"),
        "structured": next((k for k in ("json_schema", "regex", "choice") if structured.get(k) is not None), None),
    }
    report["device"] = runinfo.device_facts(config, report["versions"])
    model = runinfo.model_facts(config, report["device"])
    report["model"] = stored_model if "note" in model and stored_model and "note" not in stored_model else model
    report["times"] = runinfo.run_times(steps, rows, run)
    report.update(compute_report(steps, rows, manifest))
    report["headline"] = _headline(report, rows)
    schema = stored_schema or answers.load_schema(config)  # the schema as it was at run time, once recorded
    report["schema"] = schema
    try:
        report["samples"], report["answers"] = _answers_sections(out, config, schema, manifest, rows)
    except Exception as e:  # the numbers above must still be written
        log.warning("report: the sample answers and answer fields could not be read: %s: %s", type(e).__name__, e, exc_info=True)
        report["samples"], report["answers"] = {"note": f"could not read the answers: {e}"}, None
    return report, steps, rows


def write_report(out_dir: "str | Path | Location", run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write `report.json` and then `report.html` in out_dir's records folder (io/layout.py); returns the report dict."""
    report, steps, rows = write_report_json(out_dir, run)
    write_report_page(out_dir, report, steps, rows)
    return report


def write_report_json(out_dir: "str | Path | Location", run: dict[str, Any] | None = None) -> tuple[dict[str, Any], pl.DataFrame, pl.DataFrame]:
    """Write `report.json` (what downstream tools read; no plot is drawn for it); returns (report, steps,
    rows) for write_report_page."""
    out = layout.output_dir(out_dir)
    report, steps, rows = build_report(out, run)
    json_path = layout.report_json_path(out)
    json_path.parent.makedirs()
    json_path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    log.info("wrote %s", json_path)
    return report, steps, rows


def write_report_page(out_dir: "str | Path | Location", report: dict[str, Any], steps: pl.DataFrame, rows: pl.DataFrame) -> None:
    """Write `report.html` (the plots: most of the report's time) from what write_report_json returned."""
    from batchinfer.observe.page import render_html  # matplotlib is imported only when a page is drawn

    html_path = layout.report_html_path(out_dir)
    html_path.write_text(render_html(report, steps, rows))
    log.info("wrote %s", html_path)


def summary_text(report: dict[str, Any]) -> str:
    """The few lines a person reads at the end of a run."""
    from batchinfer.observe import labels as L

    t, tp, lat, kv, h = report["totals"], report["throughput"], report["latency_s"], report["kv"], report["headline"]
    m, d = report["model"], report["device"]
    reasons = ", ".join(f"{k} {v:,}" for k, v in t["finish_reasons"].items()) or "none"
    roof = h["roofline"]
    lines = [
        f"batchinfer report: {report['out_dir']}",
        "model {} ({}) on {}".format(*L.model_text(m), L.device_text(d)) if m.get("name") else f"model not recorded; device {L.device_text(d)}",
        f"rows {t['rows']:,} (ok {t['ok']:,}, error {t['errors']:,}); {L.plural(h['rows_rejected'], 'input line')} rejected; finish: {reasons}",
        f"wall time {L.seconds(h['wall_s'])} over {L.plural(t['runs'], 'run')}; {L.num(h['documents_per_hour'])} documents/h; "
        f"{L.num(tp['completion_tokens_per_s'])} output tok/s while generating"
        + (f"; {L.pct(roof['fraction'])} of the roofline" if "fraction" in roof else ""),
        f"tokens: prompt {t['prompt_tokens']:,}, completion {t['completion_tokens']:,}; engine time "
        f"{L.seconds(tp['engine_s'])}, {t['steps']:,} steps, {L.num(tp['rows_per_s'])} rows/s, "
        f"{L.num(tp['total_tokens_per_s'])} total tok/s",
        "latency p50/p90/p99: "
        + "; ".join(
            f"{L.LATENCY_LABELS[name].split(' (')[0].lower()} {L.seconds(x['p50'])}/{L.seconds(x['p90'])}/{L.seconds(x['p99'])}"
            for name, x in lat.items()
        ),
    ]
    if kv["total_blocks"]:
        lines.append(
            f"KV blocks: peak {kv['peak_used']:,} of {kv['total_blocks']:,} ({L.pct(kv['peak_used_frac'])}), "
            f"mean {L.pct(kv['mean_used_frac'])}; preemptions {t['step_preemptions']:,}"
        )
    sp = report.get("speculative")
    if sp:
        lines.append(
            f"speculative decoding: drafted {sp['drafted']:,}, verified {sp['verified']:,}, accepted {sp['accepted']:,} "
            f"({L.pct(sp['acceptance'])}); mean accepted per sequence-step {L.num(sp['mean_accepted_per_seq_step'])}; "
            f"tokens per sequence per forward {L.num(sp['tokens_per_seq_per_forward'])}"
            + ("; accepted by source: " + ", ".join(f"{k.replace('_', '-')} {v:,}" for k, v in sp["accepted_by_source"].items())
               if sp.get("accepted_by_source") else "")
        )
    for kind, e in report["errors_by_kind"].items():
        lines.append(f"error {kind}: {e['count']:,} (e.g. row {e['example_id']})")
    out = report.get("output")
    if out is not None and not out["matches_records"]:
        lines.append(
            f"note: the output holds {out['rows']:,} rows ({out['errors']:,} errors) but only "
            f"{t['rows']:,} have records (rows done without the observer are not in these numbers)"
        )
    lines.append(f"page: {layout.report_html_path(report['out_dir'])}")
    return "\n".join(lines)


def previous_facts(out_dir: "str | Path | Location") -> dict[str, Any]:
    """The run's own facts (config, fingerprint, versions, model, schema, driver summary) from the
    `report.json` the run wrote, for a report rebuilt later; {} when there is none."""
    prev = layout.report_json_path(out_dir)
    if not prev.exists():
        return {}
    try:
        old = json.loads(prev.read_text())
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s); the run's config and versions are left out", prev, e)
        return {}
    run = dict(old.get("run") or {})
    for key in RUN_FACTS:
        if old.get(key) is not None:
            run[key] = old[key]
    return run


def check_records(out_dir: "str | Path | Location") -> Location:
    """out_dir as a Location; FileNotFoundError (one line) when it is no folder or has no run records.
    An output folder of an older version has its records moved beside it first (unless a run holds its lock)."""
    out = layout.output_dir(out_dir)
    if not out.is_dir():
        raise FileNotFoundError(f"{out}: no such output folder")
    _migrate_unless_locked(out)
    steps, rows = layout.steps_dir(out), layout.rows_dir(out)
    if not part_locations(steps) and not part_locations(rows):
        raise FileNotFoundError(f"{out}: no run records ({steps}/, {rows}/); was it written by batchinfer run?")
    return out


def _migrate_unless_locked(out: Location) -> None:
    """Move an older version's records out of `out` (under its lock; a running job has done it already)."""
    from batchinfer.io.manifest import lock_output
    from batchinfer.job.spec import JobError

    if not layout.legacy_manifest_path(out).exists() and not (out / "_rows").is_dir() and not (out / "_steps").is_dir():
        return
    try:
        lock = lock_output(out)
    except JobError:
        return
    try:
        layout.migrate_legacy(out)
    finally:
        lock.close()


def report_command(out_dir: "str | Path | Location") -> str:
    """`batchinfer report OUT_DIR`: rebuild `report.json`/`report.html` from the records; return the summary.

    The run's own facts are kept from the previous `report.json` when there is one (previous_facts).
    """
    out = check_records(out_dir)
    return summary_text(write_report(out, previous_facts(out)))
