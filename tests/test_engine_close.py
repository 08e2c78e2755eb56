"""An Engine lets go of what it holds: close() releases the KV cache, the model and the grammar state at
once, and a dropped engine is freed by reference counting alone (no cycle waits for the garbage
collector, which on a GPU could otherwise free another engine's CUDA graphs in the middle of a new
engine's capture). The GPU side (graphs, pools, memory back to where it started) is in
tests/test_gpu_engine.py.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.structured.base import Constraint


def _requests() -> list[Request]:
    return [
        Request("plain", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)),
        Request("stop", [5, 6, 7, 8], SamplingParams(max_tokens=6, stop=["zz"])),
        Request("json", [9, 10], SamplingParams(max_tokens=6), constraint=Constraint.choice(["yes", "no"])),
    ]


def _engine(tiny_model) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=64))


def test_a_dropped_engine_is_freed_without_the_garbage_collector(tiny_model):
    gc.collect()
    gc.disable()
    try:
        engine = _engine(tiny_model)
        assert len(list(engine.generate(_requests()))) == 3
        assert engine.grammar.in_use
        refs = [weakref.ref(x) for x in (engine, engine.runner, engine.runner.model, engine.scheduler, engine.grammar)]
        del engine
        assert [r() is None for r in refs] == [True] * len(refs)
    finally:
        gc.enable()


def test_close_releases_the_cache_the_model_and_the_grammars(tiny_model):
    engine = _engine(tiny_model)
    first = {r.request_id: r.output_token_ids for r in engine.generate(_requests())}
    cache = weakref.ref(engine.runner.kv_caches[0][0]._base)  # the one tensor every layer's K/V views
    model = weakref.ref(engine.runner.model)
    engine.close()
    assert cache() is None and model() is None and engine.runner.kv_caches == []
    assert not engine.grammar.in_use
    engine.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        list(engine.generate(_requests()))
    with _engine(tiny_model) as again:
        assert {r.request_id: r.output_token_ids for r in again.generate(_requests())} == first
    assert again.runner.model is None


def test_close_refuses_while_generating(tiny_model):
    engine = _engine(tiny_model)
    results = engine.generate(_requests())
    next(results)
    with pytest.raises(RuntimeError, match="while generate"):
        engine.close()
    results.close()  # the caller stops iterating: now it may close
    engine.close()
    assert engine.runner.kv_caches == []
