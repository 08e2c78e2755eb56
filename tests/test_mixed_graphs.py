"""Mixed-step CUDA graphs (engine/cuda_graphs.py MixedGraphs) and the extend tile map they rely on.

The graph capture itself needs a GPU (tests/test_gpu_engine.py); here, on the CPU through the Triton
interpreter, the graph's body runs eagerly on exactly what a replay would see: the static buffers
after `stage` (token rows padded to the size ladder, decode rows past the step's decodes with
context 0, the tile map padded with -1, stale rows from a larger earlier step) must give the same
logits as the step run unpadded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.cuda_graphs import MixedGraphs, VerifyGraphs, mixed_graph_sizes, verify_graph_sizes
from batchinfer.kernels.extend_attention import extend_tile_map
from batchinfer.kernels.interpreter import ensure_interpreter


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=12),
    first=st.integers(0, 12),
    block_m=st.sampled_from([1, 4, 16, 32]),
    extra=st.integers(0, 5),
)
def test_tile_map_covers_every_query_token_once(lens, first, block_m, extra):
    first = min(first, len(lens))
    exact = extend_tile_map(lens, first, block_m)
    tiles = extend_tile_map(lens, first, block_m, size=exact.shape[1] + extra)
    assert tiles.dtype == np.int32 and tiles.shape == (2, exact.shape[1] + extra)
    assert (tiles[:, exact.shape[1] :] == -1).all()
    covered = {}
    for seq, tile in tiles[:, : exact.shape[1]].T.tolist():
        assert first <= seq < len(lens) and 0 <= tile * block_m < lens[seq]
        for tok in range(tile * block_m, min((tile + 1) * block_m, lens[seq])):
            assert (seq, tok) not in covered
            covered[(seq, tok)] = True
    assert len(covered) == sum(lens[first:])
    if exact.shape[1]:
        with pytest.raises(ValueError, match="do not fit"):
            extend_tile_map(lens, first, block_m, size=exact.shape[1] - 1)


def test_mixed_graph_sizes():
    assert mixed_graph_sizes(8192) == (128, 256, *range(512, 8193, 512))
    assert mixed_graph_sizes(300) == (128, 256, 300)
    assert mixed_graph_sizes(100) == (100,)


def test_verify_graph_sizes():
    assert verify_graph_sizes(2048) == (*range(64, 513, 64), *range(640, 2048, 128), 2048)
    assert verify_graph_sizes(200) == (64, 128, 192, 200)
    assert verify_graph_sizes(40) == (40,)


@pytest.fixture(scope="module")
def triton_runner(tiny_model):
    if not ensure_interpreter():
        pytest.skip("needs the Triton interpreter (a process without CUDA Triton)")
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.model_runner import ModelRunner

    cfg = EngineConfig(
        model=str(tiny_model), device="cpu", dtype="float32", attention_backend="triton",
        num_kv_blocks=160, block_size=4, max_num_seqs=6, max_num_batched_tokens=300,
    )
    return ModelRunner(cfg)


def _step(runner, starts, lens, tables, samples, seed):
    rng = np.random.default_rng(seed)
    ids = [rng.integers(0, runner.vocab_size, n).tolist() for n in lens]
    return runner._pack(starts, lens, ids, tables, samples)


def test_staged_padded_step_gives_the_eager_logits(triton_runner):
    runner = triton_runner
    assert runner.mixed_graphs is None  # no graphs on the CPU; built by hand below
    seqs = runner.config.max_num_seqs
    buffers = runner.attention.graph_buffers(300, seqs, runner.max_blocks_per_seq, False, runner.device)
    graphs = MixedGraphs(buffers, 300, seqs, runner.vocab_size, torch.float32, runner.device)
    # wide: sample rows for every sequence's drafts (model_runner._mixed_graph_samples), more than the
    # smaller sizes' tokens
    wide = MixedGraphs(runner.attention.graph_buffers(300, seqs, runner.max_blocks_per_seq, False, runner.device),
                       300, 300, runner.vocab_size, torch.float32, runner.device)
    # sequences 0..2 are prefilled in step 1; in step 2, 0 and 1 decode, 2 continues its prompt and 3
    # starts one (padded to 256 rows); step 3 (padded to 128) is smaller, so stale rows of step 2
    # sit in the buffers: sample rows past 128 and tiles of sequence 3, whose stale query rows
    # overlap step 3's real rows, unless stage() clears them
    m = runner.attention.tile_tokens
    assert 8 <= m <= 32, m
    tables = [list(range(40 * i, 40 * (i + 1))) for i in range(4)]
    steps = [
        ([0, 0, 0], [70, 90, 60], tables[:3], [True, True, False]),
        ([70, 90, 60, 0], [1, 1, 23, 150], tables, [True, True, False, True]),
        ([71, 91, 83], [1, 1, 2 * m], tables[:3], [True, True, False]),
    ]
    for i, (starts, lens, tabs, samples) in enumerate(steps):
        batch = _step(runner, starts, lens, tabs, samples, seed=i)
        assert batch.meta.extend_tiles is not None
        assert batch.meta.num_decode_rows == next((j for j, n in enumerate(lens) if n != 1), len(lens))
        assert graphs.fits(batch.input_ids.shape[0], batch.meta, batch.sample_index.shape[0])
        eager = runner.forward(batch).clone()
        t = graphs.stage(batch.input_ids, batch.positions, batch.meta, batch.sample_index)
        assert t == graphs.sizes[np.searchsorted(graphs.sizes, sum(lens))] and t > sum(lens)
        padded = runner._logits_at(*graphs.args(t))[: batch.sample_index.shape[0]]
        assert torch.isfinite(padded).all()
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4, msg=f"step {i}")
        assert wide.stage(batch.input_ids, batch.positions, batch.meta, batch.sample_index) == t
        args = wide.args(t)
        assert args[3].shape[0] == min(t, 300)  # the LM head gathers no more rows than t tokens can sample
        torch.testing.assert_close(runner._logits_at(*args)[: batch.sample_index.shape[0]], eager, rtol=1e-4, atol=1e-4,
                                   msg=f"wide, step {i}")


def test_torch_backend_steps_have_no_tile_map(tiny_model):
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.model_runner import ModelRunner

    runner = ModelRunner(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", num_kv_blocks=16))
    batch = _step(runner, [0, 0], [5, 1], [[0, 1], [2]], [True, True], seed=0)
    assert batch.meta.extend_tiles is None and runner.mixed_graphs is None and not runner.uses_graph(batch)


def test_staged_verify_step_samples_every_row_like_the_eager_step(triton_runner):
    """A verify step (every sequence with drafts, each position sampled) samples more rows than a
    mixed graph gathers (max_num_seqs): it fits the verify graphs, whose staged, padded body gives the
    eager logits of every sampled row, also after a larger step left stale rows."""
    import torch.nn.functional as F  # noqa: F401

    runner = triton_runner
    seqs = runner.config.max_num_seqs
    buffers = runner.attention.graph_buffers(200, seqs, runner.max_blocks_per_seq, False, runner.device)
    graphs = VerifyGraphs(buffers, 200, runner.vocab_size, torch.float32, runner.device)
    mixed = MixedGraphs(runner.attention.graph_buffers(200, seqs, runner.max_blocks_per_seq, False, runner.device),
                        200, seqs, runner.vocab_size, torch.float32, runner.device)
    tables = [list(range(20 * i, 20 * (i + 1))) for i in range(6)]  # 120 of the runner's 160 blocks (4 tokens each)
    steps = [([0] * 6, [30, 25, 40, 20, 35, 28]), ([30, 25, 40, 20, 35, 28], [5, 3, 5, 1, 4, 2]), ([35, 28, 45], [2, 5, 1])]
    for i, (starts, lens) in enumerate(steps):
        batch = _step(runner, starts, lens, tables[: len(lens)], [True] * len(lens), seed=10 + i)
        if i:  # every position of every chunk samples, as a verify step's do
            ends = np.cumsum(lens)
            rows = np.concatenate([np.arange(e - n, e) for e, n in zip(ends, lens)])
            batch.sample_index = torch.as_tensor(rows, dtype=torch.int64)
        samples = batch.sample_index.shape[0]
        assert graphs.fits(batch.input_ids.shape[0], batch.meta, samples)
        assert mixed.fits(batch.input_ids.shape[0], batch.meta, samples) == (samples <= seqs)
        eager = runner.forward(batch).clone()
        t = graphs.stage(batch.input_ids, batch.positions, batch.meta, batch.sample_index)
        assert t == graphs.sizes[np.searchsorted(graphs.sizes, sum(lens))]
        padded = runner._logits_at(*graphs.args(t))[:samples]
        torch.testing.assert_close(padded, eager, rtol=1e-4, atol=1e-4, msg=f"step {i}")
