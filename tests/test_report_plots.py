"""The report's plots draw the same picture from fewer artists and points (observe/plots.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.observe import plots


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=3000),
    st.integers(1, 200),
    st.floats(0.0, 1e4, allow_nan=False),
)
def test_envelope_keeps_the_ends_and_every_columns_extremes(ys, columns, span):
    n = len(ys)
    x = np.sort(np.random.default_rng(n).uniform(0.0, span, n))
    y = np.asarray(ys, dtype=np.float64)
    ex, ey = plots.envelope(x, y, columns)
    if n <= 4 * columns:
        assert ex is x and ey is y
        return
    # a subsequence of the points, in order, with the first and the last
    assert len(ex) <= 4 * columns
    assert ex[0] == x[0] and ey[0] == y[0] and ex[-1] == x[-1] and ey[-1] == y[-1]
    assert np.all(np.diff(ex) >= 0)
    pairs = set(zip(x.tolist(), y.tolist()))
    assert all((a, b) in pairs for a, b in zip(ex.tolist(), ey.tolist()))
    # per column (equal x width): the same lowest and highest value as all the points
    lo, hi = x[0], x[-1]
    col = lambda v: np.minimum(((v - lo) / ((hi - lo) or 1.0) * columns).astype(np.int64), columns - 1)
    c, ec = col(x), col(ex)
    for k in np.unique(c):
        assert ey[ec == k].min() == y[c == k].min() and ey[ec == k].max() == y[c == k].max()
    assert ey.min() == y.min() and ey.max() == y.max()


def test_envelope_of_a_long_run_is_a_few_points_per_pixel():
    x = np.linspace(0.0, 3600.0, 200_000)
    y = np.sin(x) * 100 + np.where(np.arange(x.size) == 123_456, 1e4, 0.0)  # one spike in one step
    ex, ey = plots.envelope(x, y)
    assert len(ex) <= 4 * plots.LINE_COLUMNS and ey.max() == y.max() == y[123_456]


def test_histograms_are_one_outline_with_the_counts_numpy_gives():
    import polars as pl

    steps = pl.DataFrame({"step_ms": [1.0, 2.0, 2.5, 9.0, None], "schedule_ms": [0.1, 0.2, 0.2, 0.3, 0.1]})
    fig = plots.step_times(steps)
    whole, sched = fig.axes[0].patches
    assert whole.get_data().values.tolist() == np.histogram([1.0, 2.0, 2.5, 9.0], bins=50)[0].tolist()
    assert sched.get_data().values.sum() == 5 and fig.axes[0].get_ylim()[0] == 0


def _inside(fig) -> None:
    """Every label of the drawn figure lies on it, and no axis label runs into its tick labels."""
    from batchinfer.observe import margins

    canvas = margins.fit(fig)
    canvas.draw()
    r = canvas.get_renderer()
    tight = fig.get_tightbbox(r)  # inches, of what was drawn
    w, h = fig.get_size_inches()
    assert tight.x0 >= -0.01 and tight.y0 >= -0.01 and tight.x1 <= w + 0.01 and tight.y1 <= h + 0.01, (tight, w, h)
    for ax in fig.axes:
        assert ax.bbox.width > 50 and ax.bbox.height > 30
        for axis, lo, hi in ((ax.xaxis, ax.bbox.x0, ax.bbox.x1), (ax.yaxis, ax.bbox.y0, ax.bbox.y1)):
            if not axis.get_visible() or not axis.label.get_text():
                continue
            label = axis.label.get_window_extent(r)
            for t in axis.get_ticklabels():
                b = t.get_window_extent(r)
                middle = (b.x0 + b.x1) / 2 if axis is ax.xaxis else (b.y0 + b.y1) / 2
                if t.get_visible() and t.get_text() and lo - 1 <= middle <= hi + 1:  # a tick that is drawn
                    assert not label.overlaps(b), (axis.label.get_text(), t.get_text())


@pytest.mark.parametrize("scale,seconds,value", [(0.01, 0.5, "a"), (3e5, 7200.0, "letter"),
                                                 (1e7, 60.0, "a much longer answer value, as enums of real schemas have")])
def test_figures_fit_their_labels_at_any_scale(scale, seconds, value):
    import polars as pl

    n = 400
    t = np.linspace(0.01, seconds, n)
    steps = pl.DataFrame({
        "elapsed": t, "num_prefill_tokens": (np.arange(n) % 7 * scale).astype(np.int64),
        "num_decode_tokens": np.full(n, int(scale) + 1), "num_running": (np.arange(n) % 300).astype(np.int64),
        "num_waiting": np.full(n, int(scale)), "kv_blocks_used": np.arange(n), "kv_blocks_free": np.full(n, 1000),
        "step_ms": t * scale + 1, "schedule_ms": t,
    })
    rows = pl.DataFrame({"elapsed": t, "prompt_tokens": (np.arange(n) * scale).astype(np.int64) + 1,
                         "completion_tokens": np.arange(n) % 50})
    lat = {k: {"count": n, "p50": scale, "p90": 2 * scale, "p99": 3 * scale} for k in plots.LATENCY_COLUMNS}
    for fig in (plots.throughput(steps, rows), plots.occupancy(steps), plots.lengths(rows), plots.step_times(steps),
                plots.latency({"latency_s": lat}), plots.value_counts("field", [(value, 3), ("b", int(scale) + 1)], 10),
                plots.histogram("h", [0.0, scale, 2 * scale], [3, 4], False)):
        _inside(fig)
