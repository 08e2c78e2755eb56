"""The report's plots draw the same picture from fewer artists and points (observe/plots.py)."""

from __future__ import annotations

import numpy as np
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
    col = lambda v: np.minimum(((v - lo) / ((hi - lo) or 1.0) * columns).astype(np.int64), columns - 1)  # noqa: E731
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
