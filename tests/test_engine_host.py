"""The engine's host-side helpers: graph ladder, vectorised block tables, cached sampling rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from batchinfer.engine.cuda_graphs import graph_batch_sizes
from batchinfer.attention.base import concat_aligned
from batchinfer.engine.model_runner import block_table


def test_graph_ladder():
    assert graph_batch_sizes(256) == (256,)
    assert graph_batch_sizes(40) == (40,)
    assert graph_batch_sizes(1) == (1,)
    assert graph_batch_sizes(300) == (256, 300)
    assert graph_batch_sizes(1024) == (256, 512, 1024)


@given(st.integers(1, 5000))
def test_graph_ladder_covers_every_batch(max_num_seqs):
    """Sorted, distinct, ending at max_num_seqs; nothing below 256 rows but max_num_seqs itself; a
    batch over 256 rows pads to at most twice its rows."""
    sizes = graph_batch_sizes(max_num_seqs)
    assert list(sizes) == sorted(set(sizes)) and sizes[-1] == max_num_seqs and sizes[0] == min(256, max_num_seqs)
    assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 10_000), max_size=9), max_size=12), st.integers(1, 10))
def test_block_table_matches_a_loop(tables, width):
    expected = np.zeros((len(tables), width), dtype=np.int32)
    for b, blocks in enumerate(tables):
        n = min(len(blocks), width)
        expected[b, :n] = blocks[:n]
    got = block_table(tables, width)
    assert got.dtype == np.int32 and np.array_equal(got, expected)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6), st.sampled_from([np.int64, np.int32]))
def test_packed_parts_start_16_byte_aligned(lengths, dtype):
    """Every view into a step's packed host->device buffer starts on a 16-byte boundary, whatever
    the token count, so Triton never sees a new pointer alignment mid-run (a recompile)."""
    parts = [np.arange(n, dtype=dtype) + 100 * i for i, n in enumerate(lengths)]
    buf, starts = concat_aligned(parts)
    assert buf.dtype == dtype
    for p, start in zip(parts, starts):
        assert (start * buf.itemsize) % 16 == 0
        assert np.array_equal(buf[start : start + len(p)], p)


def test_step_inputs_are_aligned_views(tiny_model):
    """prepare() of a mixed step with an odd token count: every input tensor is 16-byte aligned."""
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
    from batchinfer.engine.sequence import Sequence

    engine = Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=64))
    seqs = []
    for i, n in enumerate((5, 3, 1)):
        ids = list(range(1, n + 1))
        s = Sequence(i, Request(f"r{i}", ids, SamplingParams(max_tokens=2)), list(ids), n, 2)
        s.block_ids = engine.allocator.allocate(1)
        seqs.append(s)
    batch = engine.runner.prepare(seqs, [5, 3, 1], [True, True, True])
    meta = batch.meta
    views = [batch.input_ids, batch.positions, batch.sample_index, meta.slot_mapping,
             meta.query_start_loc, meta.seq_lens, meta.block_tables]
    assert all(t.data_ptr() % 16 == 0 for t in views)
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 1, 2, 3, 1]
    assert meta.query_start_loc.tolist() == [0, 5, 8, 9] and meta.seq_lens.tolist() == [5, 3, 1]


def test_sampling_batch_matches_make_sampling_batch(tiny_model):
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
    from batchinfer.engine.sampler import make_sampling_batch
    from batchinfer.engine.sequence import Sequence

    engine = Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=64))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5, seed=-3),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.05, seed=2**70 + 11),
        SamplingParams(temperature=0.5, seed=7),
    ]
    seqs = [Sequence.from_request(i, Request(f"r{i}", [1, 2, 3], p), seed=p.seed or 99) for i, p in enumerate(params)]
    for i, s in enumerate(seqs):
        s.token_ids += [5] * i  # different step counters
    for subset in (seqs, seqs[1:], [seqs[0]], [seqs[3], seqs[1]]):
        got = engine.runner.sampling_batch(subset)
        want = make_sampling_batch([s.request.sampling for s in subset], [s.seed for s in subset],
                                   [s.num_generated for s in subset], "cpu")
        for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps", "greedy"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for name in ("all_greedy", "any_greedy", "any_top_k", "any_top_p", "any_min_p", "all_top_k", "max_top_k"):
            assert getattr(got, name) == getattr(want, name), name


def test_torch_threads_is_applied_and_validated(tiny_model):
    from batchinfer.engine import Engine, EngineConfig

    with pytest.raises(ValueError, match="torch_threads"):
        EngineConfig(model=str(tiny_model), torch_threads=0)
    before = torch.get_num_threads()
    try:
        Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=16, torch_threads=1))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("prompt_len, expected_first", [(100, 8), (5, 52)])
def test_requests_are_taken_as_the_next_step_needs_them(tiny_model, prompt_len, expected_first):
    """generate() takes, before its first step, max_num_seqs // 8 requests and then only what that
    step can admit (its token budget, its free slots), not the whole 2 x max_num_seqs queue; every
    request still finishes once, and the queue still fills up to 2 x max_num_seqs."""
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

    taken: list[int] = []
    at_step: list[int] = []
    waiting: list[int] = []
    engine = Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=2048,
                                 max_num_seqs=64, max_num_batched_tokens=256),
                    on_step=lambda s: at_step.append(len(taken)) or waiting.append(s.num_waiting))

    def requests():
        for i in range(300):
            taken.append(i)
            yield Request(f"r{i}", [1 + (i + j) % 50 for j in range(prompt_len)], SamplingParams(max_tokens=3))

    results = list(engine.generate(requests()))
    assert sorted(r.request_id for r in results) == sorted(f"r{i}" for i in range(300))
    assert at_step[0] == expected_first
    assert max(waiting) <= 2 * 64 and (prompt_len == 5 or max(waiting) > 64)
