"""RMSNorm and fused residual-add + RMSNorm.

One program per row; the whole hidden dimension is one tile (hidden sizes of the supported
models fit in registers), statistics in float32. The math follows Hugging Face Llama:
normalise in float32, round to the input dtype, then multiply by the weight.

The FP8 variants (rms_norm_fp8, fused_add_rms_norm_fp8) feed an FP8 projection directly: the same
kernel, with FP8_OUT, rounds the normed row to the input dtype as the plain kernel stores it, then
quantises it per token as kernels/fp8_quant.py does (amax / 448, division rounded to nearest, e4m3
rounding by hand) while the row is still in registers. It writes the e4m3 row and its float32 scale
instead of the 16-bit row, so the separate quantisation kernel, and its two reads and one write of
the activation, go away. The bytes equal rms_norm followed by quantize_fp8_tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import pow2
from batchinfer.kernels.fp8_quant import FP8_MAX, MIN_SCALE, e4m3_scale, to_e4m3


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr,
    s_x0, s_x1, s_r0, s_r1, s_o, s_ro, inner, eps, fp8_max, min_scale,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FP8_OUT: tl.constexpr,
):
    # rows of x are (i, j) pairs of a [outer, inner, N] strided view: per-head norms (Qwen3 q/k
    # norm) then read q straight out of the fused qkv output without a copy
    row = tl.program_id(0).to(tl.int64)
    i = row // inner
    j = row % inner
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    x = tl.load(x_ptr + i * s_x0 + j * s_x1 + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + i * s_r0 + j * s_r1 + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * s_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * normed.to(tl.float32)
    if FP8_OUT:  # per-token e4m3 of the row rounded to x's dtype (what the plain kernel would store)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        scale = e4m3_scale(tl.max(tl.abs(y), 0), fp8_max, min_scale)
        tl.store(scale_ptr + row, scale)
        y = to_e4m3(y, scale, fp8_max)
    tl.store(out_ptr + row * s_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> a [outer, inner, N] view with unit stride on the last dim (a copy only when it must)."""
    inner = t.shape[-2] if t.dim() > 2 else 1
    t3 = t.reshape(-1, inner, t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, fp8: bool = False):
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"RMSNorm weight has shape {tuple(weight.shape)}, expected ({n},)")
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    if fp8 and (x.dim() != 2 or out_dtype != x.dtype):
        raise ValueError(f"the FP8 RMSNorm takes x [T, N] with a weight of x's dtype, got {tuple(x.shape)}, {weight.dtype}")
    x3 = _rows(x)
    rows = x3.shape[0] * x3.shape[1]
    out = torch.empty(rows, n, dtype=torch.float8_e4m3fn if fp8 else out_dtype, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device) if fp8 else out
    if residual is None:
        r3, res_out = x3, out
    else:
        if residual.shape != x.shape:
            raise ValueError(f"residual shape {tuple(residual.shape)} differs from x {tuple(x.shape)}")
        r3 = _rows(residual)
        res_out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x3, r3, weight.contiguous(), out, res_out, scale,
            x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), out.stride(0), res_out.stride(0),
            x3.shape[1], eps, FP8_MAX, MIN_SCALE,
            N=n, BLOCK=pow2(n), HAS_RESIDUAL=residual is not None, FP8_OUT=fp8,
            num_warps=min(max(pow2(n) // 256, 1), 16),
        )
    if fp8:
        return (out, scale), res_out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape)."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass over memory."""
    return _launch(x, residual, weight, eps)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x [T, N]) quantised per token: (float8_e4m3fn [T, N], scale [T, 1] float32)."""
    return _launch(x, None, weight, eps, fp8=True)[0]


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((e4m3 [T, N], scale [T, 1]) of rms_norm(x + residual), x + residual) in one pass over memory."""
    return _launch(x, residual, weight, eps, fp8=True)
