"""KV-cache write (reshape_and_cache): each new token's K and V go to their paged-cache slot.

One program per token copies all its KV heads (a [Hkv, D] tile) for K and V; tokens with a
negative slot (CUDA-graph padding) are skipped without a host sync. Into an FP8 cache
(float8_e4m3fn) the values are divided by the cache's per-tensor scale (k_scale / v_scale),
saturated at +-448 and rounded to nearest e4m3 (as reference.reshape_and_cache does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_last_dim_contiguous, pow2
from batchinfer.kernels.fp8_quant import FP8_MAX, to_e4m3


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    s_kt, s_kh, s_vt, s_vh,
    s_kcb, s_kcs, s_kch, s_vcb, s_vcs, s_vch,
    k_scale, v_scale, fp8_max,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k = tl.load(k_ptr + t64 * s_kt + offs_h[:, None] * s_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + t64 * s_vt + offs_h[:, None] * s_vh + offs_d[None, :], mask=mask)
    kc = k_cache_ptr + block * s_kcb + offset * s_kcs + offs_h[:, None] * s_kch + offs_d[None, :]
    vc = v_cache_ptr + block * s_vcb + offset * s_vcs + offs_h[:, None] * s_vch + offs_d[None, :]
    if FP8:
        k = to_e4m3(k.to(tl.float32), k_scale, fp8_max)
        v = to_e4m3(v.to(tl.float32), v_scale, fp8_max)
    tl.store(kc, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(vc, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [T]; < 0: skip
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write k/v into the paged caches at slot_mapping (in place); into an FP8 cache as k / k_scale, v / v_scale."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    _reshape_and_cache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        float(k_scale), float(v_scale), FP8_MAX,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=pow2(num_kv_heads), BLOCK_D=pow2(head_dim), FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
