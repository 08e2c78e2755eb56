"""Paged decode / extend attention kernels and the "triton" attention backend, on CPU through the
Triton interpreter, against the PyTorch references and the torch attention backend."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.kernels.interpreter import ensure_interpreter

if not ensure_interpreter():
    pytest.skip(
        "Triton was imported for the GPU in this process; the interpreter tests need a process of their own "
        "(on a GPU machine the kernels are checked by tests/test_kernels_gpu.py)",
        allow_module_level=True,
    )

from batchinfer.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchinfer.kernels import cache, decode_attention, extend_attention, reference  # noqa: E402

K = {"cache": cache, "decode_attention": decode_attention, "extend_attention": extend_attention}


DTYPES = [torch.float32, torch.float16]
# (num_heads, num_kv_heads, head_dim, block_size): GQA 4:2 and 8:1, MHA, a head_dim that is no power of
# two, a GQA group that is none (6: the extend kernel's tiles are 10 tokens of 64 rows, 2 of 16)
SHAPES = [(4, 2, 16, 4), (8, 1, 32, 16), (2, 2, 24, 8), (12, 2, 16, 4)]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=5e-3, atol=5e-3)


def paged_context(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed, spare_blocks=3):
    """Random K/V caches and shuffled block tables; slots no sequence owns hold NaN, so reading
    past a sequence's context poisons the output."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(max(per_seq), 1)
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, (n, s) in enumerate(zip(per_seq, seq_lens)):
        blocks = [perm.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(blocks, dtype=torch.int32)
        for i in range(s):
            blk, off = blocks[i // block_size], i % block_size
            k_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(num_kv_heads, head_dim, generator=gen).to(dtype)
    return k_cache, v_cache, tables, gen


# ---------------------------------------------------------------- decode


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("num_splits,block_n", [(4, 16), (1, 32)])
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size, num_splits, block_n):
    seq_lens = [1, 37, 70, 16]
    k_cache, v_cache, tables, gen = paged_context(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=head_dim)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K["decode_attention"].paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.25, num_splits=num_splits, block_n=block_n
    )
    close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25), dtype)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_padding_rows_are_zero(num_splits):
    """A CUDA-graph padded batch: sequences with seq_len 0 give zeros, not NaN (one split writes
    the output directly, several go through the merge kernel)."""
    k_cache, v_cache, tables, gen = paged_context([9, 0, 5], 2, 16, 4, torch.float32, seed=1)
    q = torch.randn(3, 4, 16, generator=gen)
    lens = torch.tensor([9, 0, 5], dtype=torch.int32)
    out = K["decode_attention"].paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.25, num_splits=num_splits, block_n=16
    )
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25), torch.float32)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
@pytest.mark.parametrize("dtype,num_ranges", [(torch.float32, 1), (torch.float32, 3), (torch.float16, 16)])
def test_balanced_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size, num_ranges):
    """The "balanced" work split: ranges that cut sequences (merged), hold whole ones (written
    directly), hold nothing (more ranges than tiles), and a padding row."""
    seq_lens = [1, 37, 0, 70, 16]
    k_cache, v_cache, tables, gen = paged_context(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + 7)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K["decode_attention"].paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.25, num_splits=num_ranges, block_n=16, work="balanced"
    )
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25), dtype)


@settings(max_examples=8, deadline=None)
@given(
    seq_lens=st.lists(st.integers(0, 90), min_size=1, max_size=7),
    num_ranges=st.integers(1, 12),
    work=st.sampled_from(["balanced", "sequence"]),
    seed=st.integers(0, 2**16),
)
def test_decode_work_splits_match_reference_on_any_lengths(seq_lens, num_ranges, work, seed):
    k_cache, v_cache, tables, gen = paged_context(seq_lens, 2, 16, 8, torch.float32, seed=seed)
    q = torch.randn(len(seq_lens), 6, 16, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K["decode_attention"].paged_decode_attention(
        q, k_cache, v_cache, tables, lens, 0.3, num_splits=num_ranges, block_n=16, work=work
    )
    close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3), torch.float32)


def test_decode_launch_rule():
    """kernels/decode_launch.py: 16 KB tiles, >= 32 partial rows per SM, a power of two in [2, 16];
    pure (no device, no lengths)."""
    from batchinfer.kernels.decode_launch import launch_config

    assert launch_config(64, 14, 2, 64, 2, 132).block_n == 128
    assert launch_config(64, 32, 8, 128, 2, 132).block_n == 64
    for hq, hkv in ((14, 2), (9, 3), (28, 4), (32, 8), (32, 32)):
        for b in (1, 8, 64, 256, 1024):
            c = launch_config(b, hq, hkv, 128, 2, 132)
            assert c.splits in (2, 4, 8, 16) and c.num_warps == 4 and c.num_stages == 2 and c.work == "sequence"
            assert b * hq * c.splits >= 32 * 132 or c.splits == 16
            assert c.splits == 2 or b * hq * c.splits // 2 < 32 * 132
    assert launch_config(64, 16, 8, 128, 2, 132).splits == 8 and launch_config(256, 12, 2, 128, 2, 132).splits == 2
    bal = launch_config(64, 14, 2, 64, 2, 132, work="balanced")
    assert bal.work == "balanced" and bal.splits == 198  # 3 x 132 programs over 2 KV heads
    assert launch_config(4, 8, 2, 16, 2, None).splits == 8  # the CPU interpreter
    with pytest.raises(ValueError, match="multiple"):
        launch_config(4, 6, 4, 16, 2, 132)


# ---------------------------------------------------------------- extend / prefill


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
def test_extend_matches_reference(dtype, num_heads, num_kv_heads, head_dim, block_size):
    # full prefill, a second chunk after a cached prefix, a decode token, a mid-block chunk
    seq_lens = [70, 40, 33, 21]
    query_lens = [70, 17, 1, 5]
    k_cache, v_cache, tables, gen = paged_context(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + 1)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K["extend_attention"].paged_extend_attention(
        q, k_cache, v_cache, tables, lens, qsl, max(query_lens), 0.3, block_rows=32, block_n=16
    )
    close(out, reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.3), dtype)


@settings(max_examples=6, deadline=None)
@given(
    data=st.data(),
    shape=st.sampled_from(SHAPES),
    block_rows=st.sampled_from([16, 64]),
    block_n=st.sampled_from([16, 32]),
)
def test_extend_random_batches(data, shape, block_rows, block_n):
    num_heads, num_kv_heads, head_dim, block_size = shape
    batch = data.draw(st.integers(1, 3))
    seq_lens = [data.draw(st.integers(1, 45)) for _ in range(batch)]
    query_lens = [data.draw(st.integers(1, s)) for s in seq_lens]
    k_cache, v_cache, tables, gen = paged_context(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, seed=batch)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = K["extend_attention"].paged_extend_attention(
        q, k_cache, v_cache, tables, lens, qsl, max(query_lens), 0.2, block_rows=block_rows, block_n=block_n
    )
    close(out, reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.2), torch.float32)


def test_extend_from_first_seq_leaves_earlier_rows_alone():
    """first_seq=2: the rows of sequences 0 and 1 keep what was in `out`; the rest match the reference."""
    seq_lens, query_lens = [9, 30, 21, 16], [1, 1, 6, 16]
    k_cache, v_cache, tables, gen = paged_context(seq_lens, 2, 16, 4, torch.float32, seed=7)
    q = torch.randn(sum(query_lens), 4, 16, generator=gen)
    qsl = torch.tensor([0, 1, 2, 8, 24], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    out = torch.full_like(q, 7.0)
    K["extend_attention"].paged_extend_attention(
        q, k_cache, v_cache, tables, lens, qsl, 16, 0.3, block_rows=16, block_n=16, out=out, first_seq=2
    )
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))
    close(out[2:], reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.3)[2:], torch.float32)


def test_reference_matches_naive_causal_attention():
    """The reference itself: a full prefill equals plain causal softmax attention."""
    k_cache, v_cache, tables, gen = paged_context([11], 1, 8, 4, torch.float32, seed=2)
    q = torch.randn(11, 2, 8, generator=gen)
    keys = k_cache[tables[0].long()].reshape(-1, 1, 8)[:11]
    values = v_cache[tables[0].long()].reshape(-1, 1, 8)[:11]
    scores = torch.einsum("qhd,khd->hqk", q, keys.expand(11, 2, 8)) * 0.5
    scores = scores + torch.full((11, 11), float("-inf")).triu(1)
    want = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values.expand(11, 2, 8))
    got = reference.paged_attention(q, k_cache, v_cache, tables, torch.tensor([11]), torch.tensor([0, 11]), 0.5)
    torch.testing.assert_close(got, want)


# ---------------------------------------------------------------- the "triton" backend


def test_triton_backend_matches_torch_backend_over_steps():
    """Prefill, chunked prefill, a prefix-shared sequence, then decode steps: the triton backend and
    the torch backend see the same steps on separate caches and must agree at every step."""
    torch_backend = pytest.importorskip("batchinfer.attention.torch_backend")
    paged_batch = pytest.importorskip("paged_batch")
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    triton_backend = TritonAttentionBackend(decode_splits=4, decode_block_n=16, extend_block_rows=16, extend_block_n=16)
    ref_backend = torch_backend.TorchAttentionBackend()
    (kc_t, vc_t), (kc_r, vc_r) = paged_batch.make_caches(2, 40, block_size, num_kv_heads, head_dim)
    meta = paged_batch.compare_backends_over_steps(triton_backend, ref_backend, (kc_t, vc_t), (kc_r, vc_r), num_heads,
                                                  num_kv_heads, head_dim, block_size)
    assert meta.decode_only  # the last step went through the decode kernel
    torch.testing.assert_close(torch.nan_to_num(kc_t, 9.0), torch.nan_to_num(kc_r, 9.0))


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_triton_backend_reads_and_writes_a_head_major_cache(kv_dtype):
    """The same steps as above on a head-major cache (engine kv_cache_layout "head": each KV head's
    block contiguous, seen through strides) give the torch backend's outputs on the usual layout,
    and the written cache holds the same values as a token-major one."""
    from batchinfer.attention.torch_backend import TorchAttentionBackend
    from batchinfer.engine.kv_cache import allocate_kv_cache

    paged_batch = pytest.importorskip("paged_batch")
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    (kc_h, vc_h), = allocate_kv_cache(1, 40, block_size, num_kv_heads, head_dim, kv_dtype, "cpu", layout="head")
    (kc_t, vc_t), = allocate_kv_cache(1, 40, block_size, num_kv_heads, head_dim, kv_dtype, "cpu", layout="token")
    assert kc_h.shape == kc_t.shape and kc_h.stride() != kc_t.stride()
    assert kc_h.stride(1) == head_dim  # one head's slots of a block side by side
    for c in (kc_h, vc_h, kc_t, vc_t):  # NaN: a read of an unwritten slot poisons the output
        c.view(torch.uint8).fill_(0x7F) if kv_dtype == torch.float8_e4m3fn else c.fill_(float("nan"))  # 0x7F: e4m3 NaN
    triton_backend = TritonAttentionBackend(decode_splits=4, decode_block_n=16, extend_block_rows=16, extend_block_n=16)
    paged_batch.compare_backends_over_steps(triton_backend, TorchAttentionBackend(), (kc_h, vc_h), (kc_t, vc_t), num_heads,
                                            num_kv_heads, head_dim, block_size)
    for head_major, token_major in ((kc_h, kc_t), (vc_h, vc_t)):
        torch.testing.assert_close(torch.nan_to_num(head_major.float(), 9.0), torch.nan_to_num(token_major.float(), 9.0))


@pytest.mark.parametrize("query_lens,work", [([1, 1, 1, 5, 12], "sequence"), ([1, 7], "sequence"), ([4, 1, 1], "sequence"),
                                             ([1, 1], "sequence"), ([1, 1, 1, 5, 12], "balanced"), ([1, 1], "balanced")])
def test_triton_backend_mixed_step_splits_decode_rows(query_lens, work):
    """A mixed step: its leading one-token sequences go to the decode kernel, the rest to the
    extend kernel (a one-token sequence after a prefill stays with the extend kernel); together
    they equal the reference over the whole batch."""
    from batchinfer.attention.base import AttentionMetadata

    seq_lens = [q + 11 * (i + 1) for i, q in enumerate(query_lens)]
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    k_cache, v_cache, tables, gen = paged_context(seq_lens, num_kv_heads, head_dim, block_size, torch.float32, seed=5)
    tokens = sum(query_lens)
    q = torch.randn(tokens, num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64),  # the cache is already filled
        query_start_loc=qsl, seq_lens=lens, block_tables=tables, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
        decode_only=all(n == 1 for n in query_lens),
    )
    leading = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    assert meta.num_leading_single == leading
    backend = TritonAttentionBackend(decode_splits=4, decode_block_n=16, extend_block_rows=16, extend_block_n=16,
                                     decode_work=work)
    kv = torch.zeros(tokens, num_kv_heads, head_dim)
    got = backend.forward(q, kv, kv, k_cache, v_cache, meta, 0.25)
    close(got, reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.25), torch.float32)


def test_triton_backend_zeroes_padding_tokens():
    """Tokens past the last sequence (slot -1) are not written and come back as zeros."""
    paged_batch = pytest.importorskip("paged_batch")
    backend = TritonAttentionBackend(extend_block_rows=16, extend_block_n=16)
    (kc, vc), = paged_batch.make_caches(1, 8, 4, 1, 16)
    seqs = paged_batch.PagedSequences(8, 4, seed=1)
    s = seqs.add()
    _, _, meta = seqs.step([(s, [1] * 6)])
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.tensor([-1, -1])])
    q, k, v = torch.randn(8, 2, 16), torch.randn(8, 1, 16), torch.randn(8, 1, 16)
    out = backend.forward(q, k, v, kc, vc, meta, 0.25)
    assert torch.equal(out[6:], torch.zeros(2, 2, 16))
    assert torch.isfinite(out).all()
    assert int(torch.isfinite(kc).all(-1).all(-1).sum()) == 6


def test_registry_builds_triton_backend():
    attention = pytest.importorskip("batchinfer.attention")
    if "triton" not in attention.BACKENDS:
        pytest.skip("triton backend not registered yet")
    assert attention.get_attention_backend("triton", "cpu").name == "triton"
    assert attention.get_attention_backend("triton-balanced", "cpu").decode_work == "balanced"
