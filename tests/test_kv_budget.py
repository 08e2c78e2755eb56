"""KV-cache sizing (engine/kv_budget.py): the one formula the runner, `plan` and the bench use, and the
activation estimate `plan` uses where it cannot profile.

The estimate is checked against a measured peak: the model runner's profile_step run under a dispatch
mode that counts the bytes of every live tensor storage an op created (what the device allocator's
peak counts on a GPU). On the CPU the forward runs torch paths that differ from the GPU's kernels,
but the sampler is the same code, so the configurations here are dominated by the draw.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from batchinfer.engine import kv_budget
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.kv_cache import kv_block_bytes
from batchinfer.models.loader import load_model_info

GIB = 1 << 30


@pytest.fixture(scope="module")
def info(tiny_model):
    return load_model_info(str(tiny_model), "float32", "cpu")


def _cfg(tiny_model, **kw) -> EngineConfig:
    return EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", **kw)


def test_gpu_budget_is_free_memory_after_the_weights_times_the_fraction_minus_the_reserve(tiny_model):
    cfg = _cfg(tiny_model, kv_cache_memory_fraction=0.5)
    assert kv_budget.kv_cache_bytes(cfg, "cuda", free_bytes=10 * GIB, activation_bytes=GIB) == 4 * GIB
    # the mixed-step graphs' pool keeps another activation peak
    assert kv_budget.kv_cache_bytes(cfg, "cuda", free_bytes=10 * GIB, activation_bytes=GIB, mixed_graphs=True) == 3 * GIB
    # before loading (plan): the weights still to load come off the free memory first
    assert kv_budget.kv_cache_bytes(cfg, "cuda", free_bytes=10 * GIB, activation_bytes=GIB, unloaded_weight_bytes=2 * GIB) == 3 * GIB
    assert kv_budget.kv_cache_bytes(cfg, "cuda", free_bytes=GIB, activation_bytes=GIB) == 0


def test_cpu_budget_is_kv_cache_gib(tiny_model):
    cfg = _cfg(tiny_model, kv_cache_gib=0.25)
    assert kv_budget.kv_cache_bytes(cfg, "cpu", free_bytes=123, activation_bytes=456) == GIB // 4


def test_blocks_of_a_budget_are_capped_and_overridden(tiny_model, info):
    cfg = _cfg(tiny_model, block_size=8, max_num_seqs=3, max_model_len=100)
    per_block = kv_block_bytes(info.num_layers, 8, info.num_kv_heads, info.head_dim, info.dtype)
    assert kv_budget.max_blocks_per_seq(cfg, info) == 13
    assert kv_budget.kv_cache_blocks(cfg, info, 7 * per_block + per_block // 2) == 7
    assert kv_budget.kv_cache_blocks(cfg, info, 10_000 * per_block) == 3 * 13  # max_num_seqs x max_model_len
    assert kv_budget.kv_cache_blocks(replace(cfg, num_kv_blocks=5), info, 0) == 5
    with pytest.raises(ValueError, match="does not hold a single"):
        kv_budget.kv_cache_blocks(cfg, info, per_block - 1)


def test_the_engine_allocates_what_the_formula_says(tiny_model, info):
    from batchinfer.engine.model_runner import ModelRunner

    cfg = _cfg(tiny_model, kv_cache_gib=0.002, block_size=8)
    runner = ModelRunner(cfg)
    want = kv_budget.kv_cache_blocks(cfg, info, kv_budget.kv_cache_bytes(cfg, "cpu"))
    assert runner.num_blocks == want and runner.kv_caches[0][0].shape[0] == want


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the live storages that ops create; keeps the peak."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def _drop(self, ptr: int) -> None:
        self.refs[ptr] -= 1
        if not self.refs[ptr]:
            del self.refs[ptr]
            self.live -= self.sizes.pop(ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.refs:
                    self.refs[ptr], self.sizes[ptr] = 0, t.untyped_storage().nbytes()
                    self.live += self.sizes[ptr]
                    self.peak = max(self.peak, self.live)
                self.refs[ptr] += 1
                weakref.finalize(t, self._drop, ptr)
        return out


@pytest.mark.parametrize("tokens, rows", [(256, 256), (1024, 256), (512, 64)])
def test_activation_estimate_is_near_the_measured_peak_of_the_largest_step(model_factory, tokens, rows):
    from batchinfer.engine.model_runner import ModelRunner

    model = model_factory("qwen3", vocab_size=8192)  # logits, not the CPU-only attention path (its padded tiles), dominate
    info = load_model_info(str(model), "float32", "cpu")
    cfg = _cfg(model, num_kv_blocks=4, max_num_batched_tokens=tokens, max_num_seqs=rows, max_model_len=tokens)
    runner = ModelRunner(cfg)
    meter = _LiveBytes()
    with meter, torch.inference_mode():
        runner.profile_step()
    estimate = kv_budget.estimate_activation_bytes(cfg, info)
    assert 0.8 * meter.peak <= estimate <= 1.5 * meter.peak, (estimate, meter.peak)
    # more tokens or more rows never lower it
    assert kv_budget.estimate_activation_bytes(replace(cfg, max_num_batched_tokens=2 * tokens), info) > estimate
    assert kv_budget.estimate_activation_bytes(replace(cfg, max_num_seqs=2 * rows), info) >= estimate


class _Allocator:
    """torch.cuda's memory as the KV sizing sees it, on the CPU: the driver's free bytes, and what
    torch's caching allocator holds without a tensor in it (given back by empty_cache)."""

    def __init__(self, free: int, cached: int) -> None:
        self.free, self.cached, self.allocated, self.peak = free, cached, 0, 0

    def empty_cache(self) -> None:
        self.free, self.cached = self.free + self.cached, 0

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (self.free, 80 << 30))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: self.peak)


@pytest.mark.parametrize("profile_cached", [False, True])
def test_memory_a_closed_engine_left_in_torchs_cache_counts_as_free(tmp_path, monkeypatch, profile_cached):
    """An engine built after another was closed in one process: the closed one's KV cache sits in
    torch's caching allocator, which the driver counts as used. The KV sizing counts it free, with
    the step profile read back from a file and with a profiling forward alike, and a stored profile
    keeps what the forward itself left in use (not what the closed engine left)."""
    from types import SimpleNamespace

    from batchinfer.engine import step_profile_cache
    from batchinfer.engine.model_runner import ModelRunner

    gib = 1 << 30
    mem = _Allocator(free=10 * gib, cached=50 * gib)
    mem.install(monkeypatch)
    path = tmp_path / "profile.json"
    if profile_cached:
        step_profile_cache.write(path, step_profile_cache.StepProfile(activation_peak_bytes=gib, retained_bytes=gib // 4))

    def profile_step() -> None:  # the largest step: 1 GiB at its peak, 256 MiB left in use after it
        mem.peak, mem.free, mem.allocated = gib, mem.free - gib // 4, gib // 4

    runner = SimpleNamespace(device=torch.device("cuda", 0), _step_profile_path=lambda: path, profile_step=profile_step,
                             step_profile_cached=False)
    free = ModelRunner._profile_free_bytes(runner)
    assert free == 60 * gib - gib // 4
    assert runner.activation_peak_bytes == gib
    assert runner.step_profile_cached == profile_cached
    assert step_profile_cache.read(path).retained_bytes == gib // 4
