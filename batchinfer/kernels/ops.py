"""Kernel dispatch: the Triton kernel for CUDA tensors, the PyTorch reference otherwise.

Callers (model layers, attention backends, the grammar step) use these functions and never
check the device themselves. Triton modules are imported lazily, so CPU-only installs without
Triton still work through the references.
"""

from __future__ import annotations

import importlib.util

import torch

from batchinfer.kernels import reference

HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """True when t lives on a CUDA device and Triton is installed."""
    return HAS_TRITON and t.is_cuda


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write new K/V [T, Hkv, D] into the paged cache at slot_mapping (slot < 0: skip); an FP8
    cache stores k / k_scale, v / v_scale."""
    if use_triton(k):
        from batchinfer.kernels.cache import reshape_and_cache as fn
    else:
        fn = reference.reshape_and_cache
    fn(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_decode_attention(
    q, k_cache, v_cache, block_tables, seq_lens, scale: float, k_scale: float = 1.0, v_scale: float = 1.0
) -> torch.Tensor:
    """One query token per sequence over its paged context: [B, Hq, D]."""
    if use_triton(q):
        from batchinfer.kernels.decode_attention import paged_decode_attention as fn

        return fn(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale=k_scale, v_scale=v_scale)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale)


def paged_extend_attention(
    q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len: int, scale: float,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's last query_len tokens over its paged context."""
    if use_triton(q):
        from batchinfer.kernels.extend_attention import paged_extend_attention as fn

        return fn(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                  k_scale=k_scale, v_scale=v_scale)
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (Hugging Face Llama math)."""
    if use_triton(x):
        from batchinfer.kernels.rmsnorm import rms_norm as fn

        return fn(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        from batchinfer.kernels.rmsnorm import fused_add_rms_norm as fn

        return fn(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def apply_rotary(q, k, positions, cos_cache, sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary on q [T, Hq, D] and k [T, Hkv, D], out of place; cos/sin caches [max_pos, R/2]."""
    if use_triton(q):
        from batchinfer.kernels.rotary import apply_rotary as fn

        return fn(q, k, positions, cos_cache, sin_cache)
    return reference.apply_rotary(q, k, positions, cos_cache, sin_cache)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:]."""
    if use_triton(x):
        from batchinfer.kernels.activation import silu_and_mul as fn

        return fn(x)
    return reference.silu_and_mul(x)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Disallowed logits -> -inf in place (bitmask convention of structured/base.py)."""
    if use_triton(logits):
        from batchinfer.kernels.bitmask import apply_token_bitmask_triton as fn
    else:
        fn = reference.apply_token_bitmask
    fn(logits, bitmask)


def rotary_with_cos_sin_cache(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for models/rope.py RotaryEmbedding.forward: cos_sin_cache is [max_pos, D] = [cos | sin]."""
    half = cos_sin_cache.shape[-1] // 2
    return apply_rotary(q, k, positions, cos_sin_cache[:, :half], cos_sin_cache[:, half:])


def quantize_fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token FP8 quantisation: x [T, K] -> (float8_e4m3fn [T, K], scale [T, 1] float32)."""
    if use_triton(x):
        from batchinfer.kernels.fp8_quant import quantize_fp8_tokens as fn

        return fn(x)
    return reference.quantize_fp8_tokens(x)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x [T, N]) as the input of an FP8 projection: (float8_e4m3fn [T, N], scale [T, 1] float32)."""
    if use_triton(x):
        from batchinfer.kernels.rmsnorm import rms_norm_fp8 as fn

        return fn(x, weight, eps)
    return reference.rms_norm_fp8(x, weight, eps)


def fused_add_rms_norm_fp8(x, residual, weight, eps: float) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((FP8 [T, N], scale [T, 1]) of rms_norm(x + residual), x + residual)."""
    if use_triton(x):
        from batchinfer.kernels.rmsnorm import fused_add_rms_norm_fp8 as fn

        return fn(x, residual, weight, eps)
    return reference.fused_add_rms_norm_fp8(x, residual, weight, eps)


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x [T, 2d]) as the input of an FP8 projection: (float8_e4m3fn [T, d], scale [T, 1])."""
    if use_triton(x):
        from batchinfer.kernels.activation import silu_and_mul_fp8 as fn

        return fn(x)
    return reference.silu_and_mul_fp8(x)
