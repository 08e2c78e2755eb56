"""Element-wise Triton kernels (KV write, RMSNorm, rotary, SiLU-and-mul, grammar bitmask) against
their PyTorch references, on CPU through the Triton interpreter (tiny shapes: it is slow)."""

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

from batchinfer.kernels import activation, bitmask, cache, ops, reference, rmsnorm, rotary  # noqa: E402

K = {"cache": cache, "rmsnorm": rmsnorm, "rotary": rotary, "activation": activation, "bitmask": bitmask}

DTYPES = [torch.float32, torch.float16]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32: relative error < 1e-4; fp16: within a couple of half-precision ulps."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2e-3, atol=2e-3)


# ---------------------------------------------------------------- KV-cache write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 16, 4), (1, 24, 8), (3, 32, 16)])
def test_reshape_and_cache_matches_reference(dtype, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(num_kv_heads * 100 + head_dim)
    tokens, num_blocks = 13, 8
    # k, v as strided slices of one fused projection, like the model produces them
    kv = torch.randn(tokens, 2 * num_kv_heads * head_dim + 5, generator=gen).to(dtype)
    k = kv[:, : num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    v = kv[:, num_kv_heads * head_dim : 2 * num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[[2, 7]] = -1  # padding: must not be written
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kc, vc = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    kr, vr = kc.clone(), vc.clone()
    K["cache"].reshape_and_cache(k, v, kc, vc, slots)
    reference.reshape_and_cache(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    written = (kc != 7.0).any(-1).any(-1).flatten().nonzero().flatten()
    assert sorted(written.tolist()) == sorted(s for s in slots.tolist() if s >= 0)


def test_reference_cache_write_matches_torch_backend():
    backend = pytest.importorskip("batchinfer.attention.torch_backend")
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([5, -1, 0, 11, 3, -1])
    a = [torch.zeros(4, 4, 2, 8) for _ in range(4)]
    reference.reshape_and_cache(k, v, a[0], a[1], slots)
    backend.write_kv(k, v, a[2], a[3], slots)
    assert torch.equal(a[0], a[2]) and torch.equal(a[1], a[3])


# ---------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 48), (1, 64), (3, 4, 24)])
def test_rms_norm_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    w = torch.randn(shape[-1], generator=gen).to(dtype)
    close(K["rmsnorm"].rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_on_strided_head_view(dtype):
    """Qwen3's per-head q norm reads q straight out of the fused qkv output."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 * 16 + 2 * 2 * 16, generator=gen).to(dtype)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    w = torch.randn(16, generator=gen).to(dtype)
    out = K["rmsnorm"].rms_norm(q, w, 1e-6)
    assert out.shape == q.shape
    close(out, reference.rms_norm(q, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(dtype):
    gen = torch.Generator().manual_seed(5)
    x, res = torch.randn(7, 40, generator=gen).to(dtype), torch.randn(7, 40, generator=gen).to(dtype)
    w = torch.randn(40, generator=gen).to(dtype)
    out, new_res = K["rmsnorm"].fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = reference.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    close(out, ref_out, dtype)


def test_rms_norm_rejects_wrong_weight():
    with pytest.raises(ValueError, match="weight"):
        K["rmsnorm"].rms_norm(torch.randn(2, 8), torch.ones(7), 1e-6)


def test_reference_norms_match_model_layer():
    layers = pytest.importorskip("batchinfer.models.layers")
    norm = layers.RMSNorm(24, 1e-6, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24))
    x, res = torch.randn(3, 24), torch.randn(3, 24)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6), norm(x))
    got, got_res = ops.fused_add_rms_norm(x, res, norm.weight, 1e-6)
    want, want_res = norm(x, res)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_res, want_res)


# ---------------------------------------------------------------- rotary


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,rotary_dim", [(4, 2, 16, 16), (8, 1, 32, 32), (3, 3, 24, 16)])
def test_rotary_matches_reference(dtype, num_heads, num_kv_heads, head_dim, rotary_dim):
    gen = torch.Generator().manual_seed(num_heads + head_dim)
    tokens = 9
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 50, (tokens,), generator=gen)
    cos, sin = reference.rotary_cos_sin(64, rotary_dim)
    ref_q, ref_k = reference.apply_rotary(q, k, positions, cos, sin)
    out_q, out_k = K["rotary"].apply_rotary(q, k, positions, cos, sin)
    close(out_q, ref_q, dtype)
    close(out_k, ref_k, dtype)
    before = qkv.clone()
    K["rotary"].apply_rotary_(q, k, positions, cos, sin)  # in place on the strided views
    close(q, ref_q, dtype)
    close(k, ref_k, dtype)
    v_part = slice((num_heads + num_kv_heads) * head_dim, None)
    assert torch.equal(qkv[:, v_part], before[:, v_part])  # v untouched


def test_rotary_reference_matches_model_rope():
    rope = pytest.importorskip("batchinfer.models.rope")
    emb = rope.RotaryEmbedding(32, 128, rope.RopeConfig(theta=10000.0))
    q, k = torch.randn(6, 4, 32), torch.randn(6, 2, 32)
    positions = torch.tensor([0, 1, 2, 50, 100, 127])
    want_q, want_k = emb(positions, q, k)
    got_q, got_k = ops.rotary_with_cos_sin_cache(positions, q, k, emb.cos_sin_cache)
    torch.testing.assert_close(got_q, want_q)
    torch.testing.assert_close(got_k, want_k)
    kq, kk = K["rotary"].apply_rotary(q, k, positions, emb.cos_sin_cache[:, :16], emb.cos_sin_cache[:, 16:])
    torch.testing.assert_close(kq, want_q, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(kk, want_k, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- SiLU-and-mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,block", [((5, 2 * 40), 1024), ((2, 3, 2 * 48), 16), ((1, 2 * 8), 1024)])
def test_silu_and_mul_matches_reference(dtype, shape, block):
    x = (2 * torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1]))).to(dtype)
    out = K["activation"].silu_and_mul(x, block=block)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    close(out, reference.silu_and_mul(x), dtype)


def test_silu_and_mul_matches_model_mlp_math():
    x = torch.randn(4, 2 * 12)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_and_mul(x), torch.nn.functional.silu(gate) * up)
    torch.testing.assert_close(K["activation"].silu_and_mul(x), torch.nn.functional.silu(gate) * up)


# ---------------------------------------------------------------- grammar bitmask


def _random_bitmask(gen: torch.Generator, batch: int, words: int) -> torch.Tensor:
    mask = torch.randint(-(2**31), 2**31, (batch, words), generator=gen, dtype=torch.int64).to(torch.int32)
    mask[0] = -1  # a row with everything allowed
    if batch > 1:
        mask[1] = 0  # a row with nothing allowed
    return mask


@settings(max_examples=8, deadline=None)
@given(
    batch=st.integers(1, 4),
    vocab=st.integers(1, 200),
    extra_words=st.integers(-2, 2),
    block=st.sampled_from([32, 64, 4096]),
    seed=st.integers(0, 1000),
)
def test_bitmask_matches_reference(batch, vocab, extra_words, block, seed):
    gen = torch.Generator().manual_seed(seed)
    words = max(1, (vocab + 31) // 32 + extra_words)  # narrower masks disallow the tail
    mask = _random_bitmask(gen, batch, words)
    logits = torch.randn(batch, vocab, generator=gen)
    want = logits.clone()
    reference.apply_token_bitmask(want, mask)
    K["bitmask"].apply_token_bitmask_triton(logits, mask, block=block)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_bitmask_bits_and_dtypes(dtype):
    vocab = 70
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[0, 0] = 1 - 2**31  # bits 0 and 31: tokens 0 and 31
    mask[0, 2] = 1 << 5  # token 69
    mask[1] = -1
    logits = torch.zeros(2, vocab, dtype=dtype)
    K["bitmask"].apply_token_bitmask_triton(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 31, 69]
    assert torch.isfinite(logits[1]).all()


def test_bitmask_agrees_with_structured_reference():
    structured = pytest.importorskip("batchinfer.structured.bitmask")
    gen = torch.Generator().manual_seed(1)
    mask = _random_bitmask(gen, 3, 4)
    logits = torch.randn(3, 128 + 20, generator=gen)  # padded logits wider than the mask
    want = structured.apply_token_bitmask_torch_(logits.clone(), mask)
    K["bitmask"].apply_token_bitmask_triton(logits, mask)
    assert torch.equal(logits, want)


def test_bitmask_rejects_bad_input():
    with pytest.raises(ValueError, match="int32"):
        K["bitmask"].apply_token_bitmask_triton(torch.zeros(1, 32), torch.zeros(1, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="must be"):
        K["bitmask"].apply_token_bitmask_triton(torch.zeros(2, 32), torch.zeros(1, 1, dtype=torch.int32))


def test_ops_use_reference_on_cpu():
    assert not ops.use_triton(torch.zeros(1))
