"""The report's matplotlib figures, made with the object API (Figure, never pyplot): drawing keeps no
global state and needs no display. Each is one row of plots; pagekit.png places them (margins.py). Every rate axis starts at 0; token-count histograms use whole-token
bins.

Drawing is kept cheap, because the page is written at the end of every run and holds up its exit code:
a histogram is one filled step outline (`stairs`) over counts numpy computed, not one rectangle per
bin (the same picture), and a per-step line of a long run is cut to its envelope per pixel column
(`envelope`: first, lowest, highest and last point of each column), which draws the same line as all
its points.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

import numpy as np
import polars as pl
from matplotlib.figure import Figure

from batchinfer.observe.labels import LATENCY_COLUMNS, LATENCY_LABELS

MAX_BINS = 80
MAX_BARS = 25
# columns a per-step line keeps (envelope): at least the pixel width of a 9-inch plot's axes at 100 dpi
LINE_COLUMNS = 800


def _empty(ax: Any, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} recorded", ha="center", va="center", transform=ax.transAxes, color="gray")


def _bin_width(span: float) -> float:
    """A round bin width giving at most MAX_BINS bins over `span` seconds."""
    for w in (0.1, 0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200):
        if span / w <= MAX_BINS:
            return float(w)
    return span / MAX_BINS


def envelope(x: np.ndarray, y: np.ndarray, columns: int = LINE_COLUMNS) -> tuple[np.ndarray, np.ndarray]:
    """The points of the line (x sorted, ascending) that a plot `columns` pixels wide can show: per
    column of equal x width, its first, lowest, highest and last point, in x order. The first and last
    point and every column's extremes are kept, so the drawn line has the same shape, peaks and ends;
    a line with no more than 4 * columns points is returned as it is."""
    n = len(x)
    if n <= 4 * columns or n == 0:
        return x, y
    lo, hi = float(x[0]), float(x[-1])
    col = np.minimum(((x - lo) / ((hi - lo) or 1.0) * columns).astype(np.int64), columns - 1)
    starts = np.flatnonzero(np.r_[True, col[1:] != col[:-1]])  # x sorted: each column one run of points
    ends = np.r_[starts[1:], n] - 1
    low = np.minimum.reduceat(y, starts)
    high = np.maximum.reduceat(y, starts)
    # the index of a column's lowest / highest point: the first point of the column equal to it
    idx = np.arange(n)
    run = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, n]))
    big = n + 1
    i_low = np.minimum.reduceat(np.where(y == low[run], idx, big), starts)
    i_high = np.minimum.reduceat(np.where(y == high[run], idx, big), starts)
    keep = np.unique(np.concatenate([starts, ends, np.where(i_low < n, i_low, starts), np.where(i_high < n, i_high, starts)]))
    return x[keep], y[keep]


def _hist(ax: Any, values: Any, bins: Any, **kw: Any) -> None:
    """A histogram as one filled outline (what ax.hist draws, without a rectangle per bin)."""
    v = np.asarray(values, dtype=np.float64)
    counts, edges = np.histogram(v[np.isfinite(v)], bins=bins)
    ax.stairs(counts, edges, fill=True, **kw)


def throughput(steps: pl.DataFrame, rows: pl.DataFrame) -> Figure:
    """Prefill and decode tokens per second, and rows finished per second, over the run."""
    fig = Figure(figsize=(9, 3.6))
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
    ax.step(x, (b.get_column("prefill") / w).to_list(), where="post", label="prefill tokens/s")
    ax.step(x, (b.get_column("decode") / w).to_list(), where="post", label="decode tokens/s")
    ax.set_xlabel(f"time since the start (s; {w:g} s bins)")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    r = rows.filter(pl.col("elapsed").is_not_null())
    if r.height:
        rb = r.with_columns((pl.col("elapsed") / w).floor().alias("bin")).group_by("bin").len().sort("bin")
        ax2 = ax.twinx()
        ax2.step((rb.get_column("bin") * w).to_list(), (rb.get_column("len") / w).to_list(), where="post",
                 color="tab:green", label="rows finished / s")
        ax2.set_ylabel("rows / s")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper right")
    ax.legend(loc="upper left")
    return fig


def occupancy(steps: pl.DataFrame) -> Figure:
    """Running and waiting sequences, and the share of KV blocks in use, per step over the run."""
    fig = Figure(figsize=(9, 3.6))
    ax = fig.add_subplot()
    ax.set_title("Sequences and KV cache use")
    if steps.height == 0:
        _empty(ax, "steps")
        return fig
    x = steps.get_column("elapsed").to_numpy().astype(np.float64)
    for col, label in (("num_running", "running"), ("num_waiting", "waiting")):
        ax.plot(*envelope(x, steps.get_column(col).to_numpy().astype(np.float64)), label=label, drawstyle="steps-post")
    ax.set_xlabel("time since the start (s)")
    ax.set_ylabel("sequences")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    ax2 = ax.twinx()
    used = steps.select(
        (100.0 * pl.col("kv_blocks_used") / (pl.col("kv_blocks_used") + pl.col("kv_blocks_free"))).fill_nan(0.0)
    ).to_series().to_numpy().astype(np.float64)
    ax2.plot(*envelope(x, used), color="tab:red", alpha=0.7, label="KV blocks used (%)")
    ax2.set_ylim(0, 105)
    ax2.set_ylabel("KV blocks used (%)")
    ax2.legend(loc="upper right")
    return fig


def integer_bins(values: list[int], max_bins: int = 50) -> list[float]:
    """Histogram edges for token counts: bins of a whole number of tokens, centred on integers."""
    lo, hi = min(values), max(values)
    width = max(1, math.ceil((hi - lo + 1) / max_bins))
    n = math.ceil((hi - lo + 1) / width)
    return [lo - 0.5 + i * width for i in range(n + 1)]


def lengths(rows: pl.DataFrame) -> Figure:
    """Histograms of prompt and output lengths (tokens, whole-token bins)."""
    fig = Figure(figsize=(9, 3.2))
    for i, (col, title) in enumerate((("prompt_tokens", "Prompt length"), ("completion_tokens", "Output length"))):
        ax = fig.add_subplot(1, 2, i + 1)
        ax.set_title(title)
        ax.set_xlabel("tokens")
        values = [int(v) for v in rows.get_column(col).drop_nulls().to_list()]
        if values:
            _hist(ax, values, integer_bins(values), color="tab:blue" if i == 0 else "tab:orange")
            ax.set_ylabel("rows")
            ax.xaxis.get_major_locator().set_params(integer=True)
        else:
            _empty(ax, "rows")
    return fig


def latency(report: dict[str, Any]) -> Figure:
    """p50/p90/p99 of queue wait, time to first token, decode time and row latency."""
    fig = Figure(figsize=(9, 3.4))
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
        ax.bar([i + (j - 1) * width for i in range(len(names))], vals, width, label={"p50": "median"}.get(p, p))
    ax.set_xticks(range(len(names)), [LATENCY_LABELS[n].split(" (")[0] for n in names])
    ax.set_ylabel("seconds")
    ax.legend()
    return fig


def step_times(steps: pl.DataFrame) -> Figure:
    """Distribution of step wall time and of its host-side scheduling part."""
    fig = Figure(figsize=(9, 3.2))
    ax = fig.add_subplot()
    ax.set_title("Engine step time")
    if steps.height == 0:
        _empty(ax, "steps")
        return fig
    _hist(ax, steps.get_column("step_ms").to_numpy(), 50, alpha=0.7, label="whole step")
    _hist(ax, steps.get_column("schedule_ms").to_numpy(), 50, alpha=0.7, label="scheduling (CPU)")
    ax.set_xlabel("ms")
    ax.set_ylabel("steps")
    ax.legend()
    return fig


def _label(text: str, width: int = 28) -> str:
    """A category label on at most two lines of `width` characters (longer ones end in an ellipsis)."""
    if len(text) <= width:
        return text
    lines = textwrap.wrap(text, width, break_long_words=True) or [text[:width]]
    if len(lines) > 2:
        lines = [lines[0], " ".join(lines[1:])[: width - 1] + "\u2026"]
    return "\n".join(lines)


def value_counts(title: str, counts: list[tuple[str, int]], total: int) -> Figure:
    """Horizontal bars of how often each value was answered, labelled with its share."""
    shown = counts[:MAX_BARS]
    fig = Figure(figsize=(4.6, 0.45 * len(shown) + 1.1))
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    labels = [_label(str(k)) for k, _ in shown][::-1]
    values = [c for _, c in shown][::-1]
    bars = ax.barh(labels, values, color="tab:blue")
    for bar, v in zip(bars, values):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {100 * v / total:.1f} %" if total else "",
                va="center", fontsize=8)
    ax.set_xlim(0, max(values + [1]) * 1.25)
    ax.set_xlabel("answers")
    ax.xaxis.get_major_locator().set_params(integer=True)
    return fig


def histogram(title: str, edges: list[float], counts: list[int], integer: bool) -> Figure:
    """A histogram drawn from precomputed bins (the report keeps the bins, not the values)."""
    fig = Figure(figsize=(4.6, 2.6))
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    if not counts:
        _empty(ax, "answers")
        return fig
    ax.stairs(counts, edges, fill=True, color="tab:purple")
    ax.set_ylabel("answers")
    ax.yaxis.get_major_locator().set_params(integer=True)
    if integer:
        ax.xaxis.get_major_locator().set_params(integer=True)
    return fig
