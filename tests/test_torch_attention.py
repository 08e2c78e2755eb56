"""The torch attention backend against a dense float64 reference, over steps that mix prefill chunks and decodes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.attention import BACKENDS, get_attention_backend
from batchinfer.attention.torch_backend import TorchAttentionBackend
from paged_batch import PagedSequences, make_caches

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_pos: int, scale: float):
    """q [n, H, D] at positions first_pos.., keys/values [S, KV, D] of the whole context; float64, causal."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        visible = first_pos + i + 1
        scores = torch.einsum("hd,shd->hs", q[i].double(), k[:visible]) * scale
        out[i] = torch.einsum("hs,shd->hd", scores.softmax(-1), v[:visible])
    return out


def run_steps(steps: list[list[tuple[int, int]]], num_seqs: int, block_size: int, seed: int = 0) -> float:
    """Run steps of (sequence, number of new tokens) through the backend; return the max error vs dense."""
    gen = torch.Generator().manual_seed(seed)
    seqs = PagedSequences(num_blocks=256, block_size=block_size, seed=seed)
    for _ in range(num_seqs):
        seqs.add()
    ((k_cache, v_cache),) = make_caches(1, 256, block_size, KV_HEADS, HEAD_DIM)
    history_k = [torch.empty(0, KV_HEADS, HEAD_DIM) for _ in range(num_seqs)]
    history_v = [torch.empty(0, KV_HEADS, HEAD_DIM) for _ in range(num_seqs)]
    backend = TorchAttentionBackend()
    scale = 1 / math.sqrt(HEAD_DIM)
    worst = 0.0
    for step in steps:
        _, _, meta = seqs.step([(s, [0] * n) for s, n in step])
        total = sum(n for _, n in step)
        q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
        k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
        out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
        start = 0
        for s, n in step:
            first_pos = history_k[s].shape[0]
            history_k[s] = torch.cat([history_k[s], k[start : start + n]])
            history_v[s] = torch.cat([history_v[s], v[start : start + n]])
            ref = dense_attention(q[start : start + n], history_k[s], history_v[s], first_pos, scale)
            worst = max(worst, (out[start : start + n].double() - ref).abs().max().item())
            start += n
    return worst


def test_mixed_prefill_chunks_and_decodes():
    steps = [
        [(0, 7), (1, 3)],  # two prefills
        [(0, 1), (1, 5), (2, 9)],  # a decode, a chunk, a new prefill
        [(0, 1), (1, 1), (2, 1)],  # decode only
        [(2, 4), (0, 1)],  # chunk after decodes
    ]
    assert run_steps(steps, num_seqs=3, block_size=4) < 1e-5


def test_decode_only_batch():
    steps = [[(0, 6), (1, 1), (2, 13)]] + [[(0, 1), (1, 1), (2, 1)]] * 5
    assert run_steps(steps, num_seqs=3, block_size=4) < 1e-5


@settings(max_examples=25, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    plan=st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9)), min_size=1, max_size=3), min_size=1, max_size=5),
    seed=st.integers(0, 1000),
)
def test_random_schedules(block_size, plan, seed):
    steps = []
    for step in plan:
        seen, chunks = set(), []
        for s, n in step:  # one chunk per sequence per step
            if s not in seen:
                seen.add(s)
                chunks.append((s, n))
        steps.append(chunks)
    assert run_steps(steps, num_seqs=3, block_size=block_size, seed=seed) < 1e-5


def test_negative_slots_are_not_written():
    seqs = PagedSequences(num_blocks=8, block_size=4)
    seqs.add()
    _, _, meta = seqs.step([(0, [0, 0, 0])])
    meta.slot_mapping[1] = -1
    ((k_cache, v_cache),) = make_caches(1, 8, 4, KV_HEADS, HEAD_DIM)
    k = torch.ones(3, KV_HEADS, HEAD_DIM)
    q = torch.ones(3, HEADS, HEAD_DIM)
    TorchAttentionBackend().forward(q, k, k, k_cache, v_cache, meta, 1.0)
    written = ~k_cache.view(-1, KV_HEADS, HEAD_DIM)[:, 0, 0].isnan()
    expected = meta.slot_mapping[meta.slot_mapping >= 0]
    assert sorted(written.nonzero().flatten().tolist()) == sorted(expected.tolist())


def test_registry():
    assert get_attention_backend("auto", "cpu").name == "torch"
    assert get_attention_backend("torch", torch.device("cpu")).name == "torch"
    assert "torch" in BACKENDS
    with pytest.raises(ValueError, match="unknown attention backend 'nope'.*torch"):
        get_attention_backend("nope", "cpu")
