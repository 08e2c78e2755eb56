"""SiLU-and-mul (the gated MLP activation): out = silu(x[..., :d]) * x[..., d:].

Grid (rows, column tiles). silu is computed in float32 and rounded to the input dtype before
the product, as Hugging Face's act_fn(gate) * up does.

silu_and_mul_fp8 feeds an FP8 down projection directly: one program a row, two passes over it in
BLOCK-wide tiles (the row's amax, then the row again, mostly from L2, divided by its scale and
rounded to e4m3 as kernels/fp8_quant.py does). It writes the e4m3 row and its float32 scale instead
of the 16-bit row, so the separate quantisation kernel (two reads and a write of the activation)
goes away. The bytes equal silu_and_mul followed by quantize_fp8_tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_last_dim_contiguous, pow2
from batchinfer.kernels.fp8_quant import FP8_MAX, MIN_SCALE, e4m3_scale, to_e4m3


@triton.jit
def _silu_mul_tile(x_ptr, row, s_x, D, cols, mask):
    """silu(gate) * up at columns `cols` of a row, rounded to x's dtype as silu_and_mul stores it (float32)."""
    gate = tl.load(x_ptr + row * s_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + D + cols, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    return (act.to(tl.float32) * up.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    out = _silu_mul_tile(x_ptr, row, s_x, D, offs, mask)  # values of x's dtype: the store below is exact
    tl.store(out_ptr + row * s_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """[..., 2d] -> [..., d]."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    check_last_dim_contiguous("x", x2)
    out = torch.empty(x2.shape[0], d, dtype=x.dtype, device=x.device)
    if x2.shape[0] and d:
        block = min(pow2(block), pow2(d))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](
            x2, out, x2.stride(0), out.stride(0), d, BLOCK=block, num_warps=4,
        )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, s_x, s_q, D, fp8_max, min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, D, BLOCK):
        out = _silu_mul_tile(x_ptr, row, s_x, D, start + offs, start + offs < D)
        amax = tl.maximum(amax, tl.abs(out))
    scale = e4m3_scale(tl.max(amax, 0), fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, D, BLOCK):
        mask = start + offs < D
        q = to_e4m3(_silu_mul_tile(x_ptr, row, s_x, D, start + offs, mask), scale, fp8_max)
        tl.store(q_ptr + row * s_q + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_fp8(x: torch.Tensor, block: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 2d] -> silu_and_mul quantised per token: (float8_e4m3fn [T, d], scale [T, 1] float32)."""
    if x.dim() != 2 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul_fp8 takes [T, 2d], got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    d = x.shape[-1] // 2
    q = torch.empty(x.shape[0], d, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device)
    if x.shape[0] and d:
        block = min(pow2(block), pow2(d))
        _silu_and_mul_fp8_kernel[(x.shape[0],)](
            x, q, scale, x.stride(0), q.stride(0), d, FP8_MAX, MIN_SCALE, BLOCK=block, num_warps=8 if block >= 2048 else 4,
        )
    return q, scale
