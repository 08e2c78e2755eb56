"""EngineConfig.mixed_streams: a step that decodes and prefills runs as a decode batch and a prefill
batch (engine/model_runner.py SplitBatch; on a GPU side by side on two streams). The tokens must be
the ones of the packed step, greedy and seeded sampling alike, with the in-flight gather of the
overlapped loop (decode rows' input ids come from the step before)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.engine.model_runner import SplitBatch, split_rows


class _Seq:
    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 50), st.integers(0, 3), st.booleans()), min_size=1, max_size=12))
def test_split_rows_puts_every_sampling_row_back_in_order(chunks):
    """Each chunk: (context before it, extra tokens it computes beyond one, samples?)."""
    seqs, starts, num_tokens, samples = [], [], [], []
    for ctx, extra, flag in chunks:
        n = 1 + extra
        seqs.append(_Seq(ctx + n + (0 if flag else 5)))  # a chunk that samples ends its sequence's tokens
        starts.append(ctx)
        num_tokens.append(n)
        samples.append(flag)
    split = split_rows(seqs, starts, num_tokens, samples)
    decode_like = [i for i, (c, n, f) in enumerate(zip(starts, num_tokens, samples)) if f and n == 1]
    if not decode_like or len(decode_like) == len(seqs):
        assert split is None
        return
    decode, prefill, order = split
    assert decode == decode_like and sorted(decode + prefill) == list(range(len(seqs)))
    # the concatenated rows (decode rows' sampling chunks, then prefill's) mapped back by `order`
    cat = [i for i in decode if samples[i]] + [i for i in prefill if samples[i]]
    assert [cat[j] for j in order.tolist()] == [i for i in range(len(seqs)) if samples[i]]


def _engine(path, mixed_streams: bool, steps: list) -> Engine:
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256, block_size=8,
                       max_num_batched_tokens=40, max_num_seqs=6, mixed_streams=mixed_streams)
    return Engine(cfg, on_step=steps.append)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_split_steps_give_the_packed_steps_tokens(tiny_model, temperature):
    rng = random.Random(7)
    reqs = [Request(f"r{i}", [rng.randrange(5, 400) for _ in range(rng.randint(10, 70))],
                    SamplingParams(max_tokens=rng.randint(3, 12), temperature=temperature, seed=i, ignore_eos=True))
            for i in range(14)]
    out = {}
    for mixed in (False, True):
        steps: list = []
        engine = _engine(tiny_model, mixed, steps)
        split = []
        prepare = engine.runner.prepare

        def counting(*a, **k):
            batch = prepare(*a, **k)
            split.append(isinstance(batch, SplitBatch))
            return batch

        engine.runner.prepare = counting
        out[mixed] = {r.request_id: r.output_token_ids for r in engine.generate(reqs)}
        engine.allocator.check()
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), "no step both prefilled and decoded"
        assert any(split) == mixed, "mixed_streams split no step" if mixed else "a step was split with mixed_streams off"
        engine.close()
    assert out[True] == out[False]
    assert len(out[True]) == len(reqs) and all(len(t) > 0 for t in out[True].values())
    np.testing.assert_equal(sorted(out[True]), sorted(r.request_id for r in reqs))
