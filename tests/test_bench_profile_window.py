"""bench throughput's profiler window (StepWindowProfiler): where it opens and how many steps it holds."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from batchinfer.bench.profile_window import StepWindowProfiler


class _FakeProfile:
    """Stands in for torch.profiler.profile: records whether it is running; writes empty tables."""

    running = False

    def __init__(self, **_kw) -> None:
        pass

    def start(self) -> None:
        _FakeProfile.running = True

    def stop(self) -> None:
        _FakeProfile.running = False

    def export_chrome_trace(self, path: str) -> None:
        open(path, "w").write("{}")

    def key_averages(self):
        return SimpleNamespace(table=lambda **_kw: "")


def _profiled(monkeypatch, tmp_path, kinds, **kw) -> list[int]:
    """The steps (1-based) that ran inside the window: 'm' is a mixed step, a number a decode-only step
    of that many rows. A step runs between the on_step calls of the steps before and after it."""
    monkeypatch.setattr(torch.profiler, "profile", _FakeProfile)
    _FakeProfile.running = False
    window = StepWindowProfiler(tmp_path, **kw)
    inside = []
    for n, k in enumerate(kinds, start=1):
        if _FakeProfile.running:
            inside.append(n)
        stats = (SimpleNamespace(num_prefill_tokens=500, num_decode_tokens=100) if k == "m"
                 else SimpleNamespace(num_prefill_tokens=0, num_decode_tokens=k))
        window.on_step(stats)
    return inside


def test_the_window_opens_after_start_step_by_default(monkeypatch, tmp_path):
    assert _profiled(monkeypatch, tmp_path, ["m", "m", "m", 256, 256, 256, "m"], start_step=3, num_steps=2) == [4, 5]
    assert (tmp_path / "trace.json").exists()


def test_with_decode_rows_it_opens_at_the_first_wide_decode_step_after_start_step(monkeypatch, tmp_path):
    kinds = [256, "m", "m", 100, 200, 250, 256, 256, 256]
    # not the decode step before start_step, not the 100-row one: after step 5, the first of >= 193 rows
    assert _profiled(monkeypatch, tmp_path, kinds, start_step=2, num_steps=3, decode_rows=193) == [6, 7, 8]
