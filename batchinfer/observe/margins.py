"""Margins for the report's figures, measured from the few strings that need room.

matplotlib's constrained layout finds the room every label needs by laying out each tick label of
every axis twice before the figure is drawn (a third time): for the report's plots that is a third of
the time of writing the page, at the end of every run. The report's figures are one row of plots (a
plot and its twin share a cell), so `fit` measures instead only what takes room outside the plots,
the tick label strings the locators and formatters give, the axis labels, the titles and offset texts,
with the Agg renderer's text metrics (one call per string, no artist layout), and sets each plot's
position. The strings are measured again once the plots have their size (a locator picks its ticks
by the room it has; a note beside a bar moves with the plot's width), keeping the larger need.
"""

from __future__ import annotations

from typing import Any

import matplotlib as mpl
from matplotlib import cbook
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

PAD_PT = 3.0  # around each plot's cell, as constrained layout's w_pad / h_pad
MAX_SIDE = 0.8  # the most of the figure's width one side's labels may take (a long category label)


def _text_size(renderer: Any, text: str, prop: Any) -> tuple[float, float]:
    """(width, height) in pixels of a string as matplotlib draws it (several lines stacked)."""
    if not text:
        return 0.0, 0.0
    width = height = 0.0
    lp = renderer.get_text_width_height_descent("lp", prop, ismath=False)[1]  # matplotlib's least line height
    for line in text.split("\n"):
        math = cbook.is_math_text(line)
        try:
            w, h, _ = renderer.get_text_width_height_descent(line, prop, ismath=math)
        except ValueError:  # not valid mathtext: drawn as plain text
            w, h, _ = renderer.get_text_width_height_descent(line, prop, ismath=False)
        width, height = max(width, w), height + max(h, lp) * (1.2 if height else 1.0)
    return width, height


def _ticks(axis: Any) -> tuple[list[str], str]:
    """The major tick labels an axis will draw (inside its view) and its offset text."""
    lo, hi = sorted(axis.get_view_interval())
    eps = (hi - lo) * 1e-9
    locs = [v for v in axis.get_major_locator()() if lo - eps <= v <= hi + eps]
    fmt = axis.get_major_formatter()
    labels = [str(s) for s in fmt.format_ticks(locs)]
    offset = fmt.get_offset() if hasattr(fmt, "get_offset") else ""
    return labels, str(offset or "")


def _needs(ax: Any, renderer: Any, pt: float) -> dict[str, float]:
    """Pixels this plot's labels take on each side of it."""
    need = {"left": 0.0, "right": 0.0, "top": 0.0, "bottom": 0.0}
    tick_font = mpl.font_manager.FontProperties(size=mpl.rcParams["ytick.labelsize"])
    xtick_font = mpl.font_manager.FontProperties(size=mpl.rcParams["xtick.labelsize"])
    y = ax.yaxis
    if y.get_visible():
        labels, offset = _ticks(y)
        side = "right" if y.get_ticks_position() == "right" else "left"
        tick = max((_text_size(renderer, s, tick_font)[0] for s in labels), default=0.0)
        room = tick + (mpl.rcParams["ytick.major.size"] + mpl.rcParams["ytick.major.pad"]) * pt if labels else 0.0
        if y.label.get_text():
            room += _text_size(renderer, y.label.get_text(), y.label.get_fontproperties())[1] + mpl.rcParams["axes.labelpad"] * pt
        label_side = y.get_label_position()
        need[side] = max(need[side], room)
        if label_side != side:  # an odd setup: count the label on its own side too
            need[label_side] = max(need[label_side], room)
        if offset:
            need["top"] = max(need["top"], _text_size(renderer, offset, tick_font)[1] + 2 * pt)
    x = ax.xaxis
    if x.get_visible():
        labels, offset = _ticks(x)
        sizes = [_text_size(renderer, s, xtick_font) for s in labels]
        room = max((h for _, h in sizes), default=0.0)
        room += (mpl.rcParams["xtick.major.size"] + mpl.rcParams["xtick.major.pad"]) * pt if labels else 0.0
        if x.label.get_text():
            room += _text_size(renderer, x.label.get_text(), x.label.get_fontproperties())[1] + mpl.rcParams["axes.labelpad"] * pt
        if offset:
            room += _text_size(renderer, offset, xtick_font)[1]
        need["bottom"] = room
        if sizes:  # the first and last labels are centred on their ticks and may stick out past the plot
            lo, hi = sorted(x.get_view_interval())
            locs = [v for v in x.get_major_locator()() if lo - (hi - lo) * 1e-9 <= v <= hi + (hi - lo) * 1e-9]
            if locs and hi > lo:
                width = ax.get_position().width * ax.figure.bbox.width
                need["left"] = max(need["left"], sizes[0][0] / 2 - (locs[0] - lo) / (hi - lo) * width)
                need["right"] = max(need["right"], sizes[-1][0] / 2 - (hi - locs[-1]) / (hi - lo) * width)
    for t in ax.texts:  # notes beside bars (value_counts) may run past the plot's right or left edge
        if not t.get_visible() or not t.get_text() or t.get_transform() is ax.transAxes:
            continue
        x = t.get_transform().transform(t.get_position())[0]
        w = _text_size(renderer, t.get_text(), t.get_fontproperties())[0]
        a = {"left": 0.0, "center": 0.5, "right": 1.0}.get(t.get_horizontalalignment(), 0.0)
        need["right"] = max(need["right"], x + (1 - a) * w - ax.bbox.x1)
        need["left"] = max(need["left"], ax.bbox.x0 - (x - a * w))
    title = ax.title.get_text()
    if title:
        need["top"] = max(need["top"], _text_size(renderer, title, ax.title.get_fontproperties())[1] + mpl.rcParams["axes.titlepad"] * pt)
    return need


def _place(fig: Figure, renderer: Any, floor: dict[int, dict[str, float]] | None = None) -> dict[int, dict[str, float]]:
    """Set each plot's position from what its labels need (at least `floor`); returns the needs."""
    pt = fig.dpi / 72.0
    W, H = fig.bbox.width, fig.bbox.height
    cells: dict[int, list[Any]] = {}
    for ax in fig.axes:
        spec = ax.get_subplotspec()
        cells.setdefault(spec.colspan.start if spec is not None else 0, []).append(ax)
    cols = sorted(cells)
    needs = {}
    for c in cols:
        per_ax = [_needs(ax, renderer, pt) for ax in cells[c]]
        needs[c] = {k: min(max([n[k] for n in per_ax] + [floor[c][k] if floor else 0.0]), W * MAX_SIDE)
                    for k in ("left", "right", "top", "bottom")}
    pad = PAD_PT * pt
    top = max(n["top"] for n in needs.values()) + pad
    bottom = max(n["bottom"] for n in needs.values()) + pad
    sides = sum(needs[c]["left"] + needs[c]["right"] + 2 * pad for c in cols)
    inner = max((W - sides) / len(cols), W * 0.1)
    height = max(H - top - bottom, H * 0.05)
    x = 0.0
    for c in cols:
        x += pad + needs[c]["left"]
        for ax in cells[c]:
            ax.set_position((x / W, bottom / H, inner / W, height / H))
        x += inner + needs[c]["right"] + pad
    return needs


def fit(fig: Figure) -> FigureCanvasAgg:
    """Place the figure's plots so their labels fit (again once the plots have their size: the ticks
    may change, a note beside a bar moves). Returns the Agg canvas the figure now draws on."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    if fig.axes:
        renderer = canvas.get_renderer()
        needs = _place(fig, renderer)
        for _ in range(3):  # once the plots have their size, ticks and notes beside bars may need more room
            again = _place(fig, renderer, needs)
            if again == needs:
                break
            needs = again
    return canvas
