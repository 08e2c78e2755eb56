"""The Triton kernels on a CUDA GPU in bfloat16 at model-like sizes: correctness against the PyTorch
references with bf16 tolerances, decode under CUDA-graph capture and replay, and timings
(triton.testing.do_bench) printed as achieved GB/s. Run with `pytest -m gpu tests/test_kernels_gpu.py -s`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DT = torch.bfloat16


def bf16_close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-2) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def bench(name: str, fn, bytes_moved: int, flops: float = 0.0) -> float:
    import triton

    ms = triton.testing.do_bench(fn, warmup=25, rep=100)
    line = f"\n[bench] {name}: {ms * 1e3:.1f} us, {bytes_moved / ms / 1e6:.0f} GB/s"
    if flops:
        line += f", {flops / ms / 1e9:.1f} TFLOP/s"
    print(line)
    return ms


def paged(seq_lens, num_kv_heads, head_dim, block_size, seed=0):
    """Random bf16 caches with shuffled block tables for the given sequence lengths."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 8
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device="cuda", dtype=DT, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=DT, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    tables = torch.zeros(len(seq_lens), max(per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[used : used + n].int()
        used += n
    return k_cache, v_cache, tables


@pytest.mark.parametrize("work", ["sequence", "balanced"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (14, 2, 64)])
def test_decode_attention_gpu(num_heads, num_kv_heads, head_dim, work):
    from batchinfer.kernels import reference
    from batchinfer.kernels.decode_attention import paged_decode_attention

    seq_lens = [1, 17, 300, 2048, 4000, 777, 64, 1500] * 8
    k_cache, v_cache, tables = paged(seq_lens, num_kv_heads, head_dim, 16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(seq_lens), num_heads, head_dim, device="cuda", dtype=DT)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, work=work)
    bf16_close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale))
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * k_cache.element_size()
    bench(f"decode ({work}) B={len(seq_lens)} H={num_heads}/{num_kv_heads} D={head_dim}",
          lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, work=work), kv_bytes)


@pytest.mark.parametrize("work", ["sequence", "balanced"])
def test_decode_attention_cuda_graph_replay(work):
    """Captured once, replayed with new lengths and block tables written into the same buffers."""
    from batchinfer.kernels import reference
    from batchinfer.kernels.decode_attention import paged_decode_attention

    k_cache, v_cache, tables = paged([512] * 16, 8, 128, 16)
    lens = torch.full((16,), 100, dtype=torch.int32, device="cuda")
    q = torch.randn(16, 32, 128, device="cuda", dtype=DT)
    out = torch.empty_like(q)
    paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, out=out, work=work)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1, out=out, work=work)
    for new_lens in ([512] * 16, [1, 2, 3, 4] * 4, [0] * 8 + [300] * 8):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        q.copy_(torch.randn_like(q))
        tables.copy_(tables.flip(0))
        graph.replay()
        torch.cuda.synchronize()
        bf16_close(out, reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1))


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(32, 8, 128), (16, 16, 64)])
def test_extend_attention_gpu(num_heads, num_kv_heads, head_dim):
    from batchinfer.kernels import reference
    from batchinfer.kernels.extend_attention import paged_extend_attention

    seq_lens = [1024, 2048, 700, 1500, 33]
    query_lens = [1024, 512, 1, 1500, 17]  # full prefill, chunk after a prefix, decode, ...
    k_cache, v_cache, tables = paged(seq_lens, num_kv_heads, head_dim, 16, seed=1)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(query_lens), num_heads, head_dim, device="cuda", dtype=DT)
    scale = head_dim**-0.5
    out = paged_extend_attention(q, k_cache, v_cache, tables, lens, qsl, max(query_lens), scale)
    bf16_close(out, reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, scale))
    flops = sum(4 * ql * (s - ql / 2) * num_heads * head_dim for ql, s in zip(query_lens, seq_lens))
    kv_bytes = 2 * sum(seq_lens) * num_kv_heads * head_dim * 2 + 2 * q.numel() * 2
    bench(f"extend T={sum(query_lens)} H={num_heads}/{num_kv_heads} D={head_dim}",
          lambda: paged_extend_attention(q, k_cache, v_cache, tables, lens, qsl, max(query_lens), scale),
          kv_bytes, flops)


def test_reshape_and_cache_gpu():
    from batchinfer.kernels import reference
    from batchinfer.kernels.cache import reshape_and_cache

    tokens, hkv, d, bs, nb = 8192, 8, 128, 16, 1024
    k = torch.randn(tokens, hkv, d, device="cuda", dtype=DT)
    v = torch.randn(tokens, hkv, d, device="cuda", dtype=DT)
    slots = torch.randperm(nb * bs, device="cuda")[:tokens]
    slots[::7] = -1
    caches = [torch.zeros(nb, bs, hkv, d, device="cuda", dtype=DT) for _ in range(4)]
    reshape_and_cache(k, v, caches[0], caches[1], slots)
    reference.reshape_and_cache(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    bench("reshape_and_cache T=8192", lambda: reshape_and_cache(k, v, caches[0], caches[1], slots), 4 * k.numel() * 2)


@pytest.mark.parametrize("hidden", [4096, 3584])
def test_rms_norm_gpu(hidden):
    from batchinfer.kernels import reference
    from batchinfer.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    x = torch.randn(4096, hidden, device="cuda", dtype=DT)
    res = torch.randn_like(x)
    w = torch.randn(hidden, device="cuda", dtype=DT)
    bf16_close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(new_res, ref_res)
    bf16_close(out, ref_out)
    nbytes = x.numel() * 2
    bench(f"rms_norm 4096x{hidden}", lambda: rms_norm(x, w, 1e-6), 2 * nbytes)
    bench(f"fused_add_rms_norm 4096x{hidden}", lambda: fused_add_rms_norm(x, res, w, 1e-6), 4 * nbytes)


def test_rotary_gpu():
    from batchinfer.kernels import reference
    from batchinfer.kernels.rotary import apply_rotary, apply_rotary_

    tokens, hq, hk, d = 8192, 32, 8, 128
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda", dtype=DT)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    positions = torch.randint(0, 32768, (tokens,), device="cuda")
    cos, sin = reference.rotary_cos_sin(32768, d, base=1e6, device="cuda")
    rq, rk = reference.apply_rotary(q, k, positions, cos, sin)
    oq, ok = apply_rotary(q, k, positions, cos, sin)
    bf16_close(oq, rq)
    bf16_close(ok, rk)
    bench("rotary in place T=8192 32/8x128", lambda: apply_rotary_(q, k, positions, cos, sin), 2 * (q.numel() + k.numel()) * 2)


def test_silu_and_mul_gpu():
    from batchinfer.kernels import reference
    from batchinfer.kernels.activation import silu_and_mul

    x = torch.randn(4096, 2 * 14336, device="cuda", dtype=DT)
    bf16_close(silu_and_mul(x), reference.silu_and_mul(x))
    bench("silu_and_mul 4096x14336", lambda: silu_and_mul(x), x.numel() * 2 * 3 // 2)


def test_bitmask_gpu():
    from batchinfer.kernels import reference
    from batchinfer.kernels.bitmask import apply_token_bitmask_triton

    batch, vocab = 256, 152064
    logits = torch.randn(batch, vocab, device="cuda")
    mask = torch.randint(-(2**31), 2**31, (batch, (vocab + 31) // 32), device="cuda", dtype=torch.int64).int()
    want = logits.clone()
    reference.apply_token_bitmask(want, mask)
    got = logits.clone()
    apply_token_bitmask_triton(got, mask)
    assert torch.equal(got, want)
    bench("bitmask 256x152064", lambda: apply_token_bitmask_triton(logits, mask), logits.numel() * 4 + mask.numel() * 4)


def test_triton_backend_matches_torch_backend_gpu():
    from batchinfer.attention.base import AttentionMetadata
    from batchinfer.attention.torch_backend import TorchAttentionBackend
    from batchinfer.attention.triton_backend import TritonAttentionBackend

    seq_lens, query_lens = [300, 64, 129], [300, 1, 40]
    k_cache, v_cache, tables = paged(seq_lens, 4, 64, 16, seed=2)
    slots = []
    for b, (s, ql) in enumerate(zip(seq_lens, query_lens)):
        for pos in range(s - ql, s):
            slots.append(int(tables[b, pos // 16]) * 16 + pos % 16)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device="cuda"),
        query_start_loc=torch.tensor([0, 300, 301, 341], dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables, max_query_len=300, max_seq_len=300,
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens, decode_only=False,
    )
    t = sum(query_lens)
    q = torch.randn(t, 16, 64, device="cuda", dtype=DT)
    k = torch.randn(t, 4, 64, device="cuda", dtype=DT)
    v = torch.randn(t, 4, 64, device="cuda", dtype=DT)
    kc2, vc2 = k_cache.clone(), v_cache.clone()
    got = TritonAttentionBackend().forward(q, k, v, k_cache, v_cache, meta, 0.125)
    want = TorchAttentionBackend().forward(q, k, v, kc2, vc2, meta, 0.125)
    assert torch.equal(k_cache, kc2) and torch.equal(v_cache, vc2)
    bf16_close(got, want)
