"""`_report.html`: one self-contained page (no external file, script or font) with matplotlib plots.

Each plot is a PNG embedded as a base64 data URI, so the page can be mailed, attached to a ticket or
opened from an object store as is. Figures are made with matplotlib's object API (Figure, never
pyplot), so drawing keeps no global state and needs no display.
"""

from __future__ import annotations

import base64
import html
import io
import json
from typing import Any

import polars as pl
from matplotlib.figure import Figure

from batchinfer.observe.report import LATENCY_COLUMNS

MAX_BINS = 80
MAX_POINTS = 2000


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="gray")


def _bin_width(span: float) -> float:
    """A round bin width giving at most MAX_BINS bins over `span` seconds (at least 1 s... or finer for short runs)."""
    for w in (0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200):
        if span / w <= MAX_BINS:
            return float(w)
    return span / MAX_BINS


def plot_throughput(steps: pl.DataFrame, rows: pl.DataFrame) -> Figure:
    """Prefill and decode tokens per second, and rows finished per second, over the run."""
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Throughput over time")
    if steps.height == 0:
        _empty(ax, "steps")
        return fig
    w = _bin_width(float(steps.get_column("elapsed").max()))  # type: ignore[arg-type]
    b = (
        steps.with_columns((pl.col("elapsed") / w).floor().alias("bin"))
        .group_by("bin")
        .agg(pl.col("num_prefill_tokens").sum().alias("prefill"), pl.col("num_decode_tokens").sum().alias("decode"))
        .sort("bin")
    )
    x = (b.get_column("bin") * w).to_list()
    ax.step(x, (b.get_column("prefill") / w).to_list(), where="post", label="prefill tok/s")
    ax.step(x, (b.get_column("decode") / w).to_list(), where="post", label="decode tok/s")
    ax.set_xlabel("seconds")
    ax.set_ylabel("tokens / s")
    r = rows.filter(pl.col("elapsed").is_not_null())
    if r.height:
        rb = r.with_columns((pl.col("elapsed") / w).floor().alias("bin")).group_by("bin").len().sort("bin")
        ax2 = ax.twinx()
        ax2.step((rb.get_column("bin") * w).to_list(), (rb.get_column("len") / w).to_list(), where="post",
                 color="tab:green", label="rows/s")
        ax2.set_ylabel("rows / s")
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    return fig


def plot_occupancy(steps: pl.DataFrame) -> Figure:
    """Running and waiting sequences, and the share of KV blocks in use, per step over the run."""
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Sequences and KV cache use")
    if steps.height == 0:
        _empty(ax, "steps")
        return fig
    if steps.height > MAX_POINTS:  # a long run: one point per time bin (means), so drawing stays fast
        w = float(steps.get_column("elapsed").max()) / MAX_POINTS  # type: ignore[arg-type]
        steps = (
            steps.with_columns((pl.col("elapsed") / w).floor().alias("bin"))
            .group_by("bin")
            .agg(pl.col("elapsed", "num_running", "num_waiting", "kv_blocks_used", "kv_blocks_free").mean())
            .sort("elapsed")
        )
    x = steps.get_column("elapsed").to_list()
    ax.plot(x, steps.get_column("num_running").to_list(), label="running", drawstyle="steps-post")
    ax.plot(x, steps.get_column("num_waiting").to_list(), label="waiting", drawstyle="steps-post")
    ax.set_xlabel("seconds")
    ax.set_ylabel("sequences")
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    used = steps.select(
        (100.0 * pl.col("kv_blocks_used") / (pl.col("kv_blocks_used") + pl.col("kv_blocks_free"))).fill_nan(0.0)
    ).to_series()
    ax2.plot(x, used.to_list(), color="tab:red", alpha=0.7, label="KV used %")
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("KV blocks used (%)")
    ax2.legend(loc="upper right")
    return fig


def plot_lengths(rows: pl.DataFrame) -> Figure:
    """Histograms of prompt and output lengths (tokens)."""
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    for i, (col, title) in enumerate((("prompt_tokens", "Prompt length"), ("completion_tokens", "Output length"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.set_title(title)
        ax.set_xlabel("tokens")
        values = rows.get_column(col).drop_nulls().to_list()
        if values:
            ax.hist(values, bins=min(50, max(5, len(set(values)))), color="tab:blue" if i == 0 else "tab:orange")
            ax.set_ylabel("rows")
        else:
            _empty(ax, "rows")
    return fig


def plot_latency(report: dict[str, Any]) -> Figure:
    """p50/p90/p99 of queue wait, time to first token, decode time and row latency."""
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Latency percentiles")
    names = list(LATENCY_COLUMNS)
    lat = report["latency_s"]
    if not any(lat[n]["count"] for n in names):
        _empty(ax, "timings")
        return fig
    width = 0.27
    for j, p in enumerate(("p50", "p90", "p99")):
        vals = [lat[n][p] or 0.0 for n in names]
        ax.bar([i + (j - 1) * width for i in range(len(names))], vals, width, label=p)
    ax.set_xticks(range(len(names)), ["queue wait", "time to first token", "decode", "row latency"])
    ax.set_ylabel("seconds")
    ax.legend()
    return fig


def plot_step_times(steps: pl.DataFrame) -> Figure:
    """Distribution of step wall time and of its host-side scheduling part."""
    fig = Figure(figsize=(9, 3.2), layout="constrained")
    ax = fig.add_subplot()
    ax.set_title("Step time")
    if steps.height == 0:
        _empty(ax, "steps")
        return fig
    ax.hist(steps.get_column("step_ms").to_list(), bins=50, alpha=0.7, label="step")
    ax.hist(steps.get_column("schedule_ms").to_list(), bins=50, alpha=0.7, label="scheduling (CPU)")
    ax.set_xlabel("ms")
    ax.set_ylabel("steps")
    ax.legend()
    return fig


def _table(rows: list[tuple[str, Any]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_cell(v))}</td></tr>" for k, v in rows)
    return f"<table>{cells}</table>"


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_cell(x)}" for k, x in v.items())
    return str(v)


def _dist_table(dists: dict[str, dict[str, Any]], unit: str) -> str:
    keys = ["count", "mean", "p50", "p90", "p95", "p99", "max"]
    head = "".join(f"<th>{k}</th>" for k in keys)
    body = "".join(
        f"<tr><th>{html.escape(name)} ({unit})</th>" + "".join(f"<td>{html.escape(_cell(d.get(k)))}</td>" for k in keys) + "</tr>"
        for name, d in dists.items()
        if isinstance(d, dict)
    )
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


CSS = """
body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1000px;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0}th,td{padding:.2em .7em;text-align:left;border-bottom:1px solid #eee}
td{font-variant-numeric:tabular-nums}img{display:block;max-width:100%;margin:.6em 0}
pre{background:#f6f6f6;padding:.8em;overflow:auto;font-size:.85em}.bad{color:#b00}
"""


def render_html(report: dict[str, Any], steps: pl.DataFrame, rows: pl.DataFrame) -> str:
    """The whole page as one string."""
    t, tp, kv = report["totals"], report["throughput"], report["kv"]
    plots = [
        ("throughput", plot_throughput(steps, rows)),
        ("occupancy", plot_occupancy(steps)),
        ("lengths", plot_lengths(rows)),
        ("latency", plot_latency(report)),
        ("step-times", plot_step_times(steps)),
    ]
    imgs = "\n".join(f'<img id="plot-{name}" alt="{name} plot" src="{_png(fig)}">' for name, fig in plots)
    out = report.get("output")
    out_html = ""
    if out is not None:
        cls = "" if out["matches_records"] else ' class="bad"'
        out_html = f"<h2>Output</h2><div{cls}>{_table(list(out.items()))}</div>"
    errors = report["errors_by_kind"]
    err_html = (
        _table([(k, f"{e['count']:,} (e.g. row {e['example_id']}: {e['example']})") for k, e in errors.items()])
        if errors else "<p>none</p>"
    )
    esc = lambda obj: html.escape(json.dumps(obj, indent=1, default=str))  # noqa: E731
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>batchinfer report</title><style>{CSS}</style></head>
<body>
<h1>batchinfer report</h1>
<p>{html.escape(report['out_dir'])}<br>generated {html.escape(report['generated_at'])}; fingerprint
<code>{html.escape(str(report.get('fingerprint')))}</code></p>
<h2>Totals</h2>{_table(list(t.items()))}
<h2>Throughput</h2>{_table(list(tp.items()))}
<h2>Latency</h2>{_dist_table(report['latency_s'], 's')}
<h2>Lengths</h2>{_dist_table(report['lengths'], 'tokens')}
<h2>Steps</h2>{_dist_table({k: v for k, v in report['step_ms'].items() if isinstance(v, dict)}, 'ms')}
{_table([("share of step time spent scheduling", report['step_ms'].get('schedule_share'))])}
<h2>KV cache</h2>{_table(list(kv.items()))}
<h2>Errors by kind</h2>{err_html}
{out_html}
<h2>Plots</h2>
{imgs}
<h2>Config</h2><pre>{esc(report.get('config'))}</pre>
<h2>Run</h2><pre>{esc(report.get('run'))}</pre>
<h2>Versions</h2><pre>{esc(report.get('versions'))}</pre>
</body></html>
"""
