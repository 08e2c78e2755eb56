"""Neox-style (rotate-half) rotary embedding for q and k in one launch.

One program per token rotates all its query and key heads; cos/sin come from float32 caches
[max_pos, R/2] indexed by the token's position (R = rotary dim <= head dim; dims past R are
left as they are). Works in place on strided views (q and k may be slices of a fused qkv).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_last_dim_contiguous, pow2


@triton.jit
def _rotate_heads(x_ptr, s_h, c, s, HEADS: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    mask = (offs_h[:, None] < HEADS) & (offs_r[None, :] < HALF)
    p1 = x_ptr + offs_h[:, None] * s_h + offs_r[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c[None, :] - x2 * s[None, :]
    o2 = x2 * c[None, :] + x1 * s[None, :]
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    s_qt, s_qh, s_kt, s_kh, s_c, s_s,
    HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_R: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    c = tl.load(cos_ptr + pos * s_c + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * s_s + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * s_qt, s_qh, c, s, HQ, HALF, BLOCK_HQ, BLOCK_R)
    _rotate_heads(k_ptr + t * s_kt, s_kh, c, s, HK, HALF, BLOCK_HK, BLOCK_R)


def apply_rotary_(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # int [T]
    cos_cache: torch.Tensor,  # [max_pos, R/2]
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k in place; returns them."""
    num_tokens, hq, head_dim = q.shape
    half = cos_cache.shape[-1]
    if 2 * half > head_dim:
        raise ValueError(f"rotary dim {2 * half} exceeds head_dim {head_dim}")
    if k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens:
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_cache, sin_cache,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_cache.stride(0), sin_cache.stride(0),
            HQ=hq, HK=k.shape[1], HALF=half,
            BLOCK_HQ=pow2(hq), BLOCK_HK=pow2(k.shape[1]), BLOCK_R=pow2(half),
        )
    return q, k


def apply_rotary(q, k, positions, cos_cache, sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place rotary: rotated copies of q and k."""
    return apply_rotary_(q.clone(), k.clone(), positions, cos_cache, sin_cache)
