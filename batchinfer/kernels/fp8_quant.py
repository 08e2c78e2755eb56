"""Per-token FP8 quantisation of activations: x [T, K] -> (x_fp8 [T, K] float8_e4m3fn, scale [T, 1] float32).

One program per row, two passes over it in BLOCK-wide tiles: the row's amax (float32), then
x / scale rounded to e4m3 (scale = amax / 448, at least 1e-12 so a row of zeros stays zeros). One
read of the 16-bit row for each pass (the second mostly from L2) and one FP8 write, where the eager
PyTorch math (reference.quantize_fp8_tokens) makes ~5 float32 passes. The math is the reference's:
the divisions are rounded to nearest (div_rn) and the rounding to e4m3 is done by hand
(round_to_e4m3), so the FP8 values are bit-identical to the reference on the CPU (interpreter). On a
GPU the reference's own division is PyTorch's, which multiplies by the reciprocal: its scale can be an
ulp away, and values on a rounding boundary then differ by one e4m3 step (0.3% of them on the H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_last_dim_contiguous, pow2

FP8_MAX = 448.0
MIN_SCALE = 1e-12


@triton.jit
def round_to_e4m3(v):
    """float32 v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, still float32: normals
    keep 3 of the 23 mantissa bits (round on the bits), subnormals (|v| < 2^-6) are multiples of 2^-9
    (adding and taking away 1.5 x 2^14 rounds there). The cast to FP8 is then exact on the GPU and in
    the interpreter alike (whose own float-to-FP8 cast does not round to nearest)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    a = tl.abs(v)
    subnormal = (a + 24576.0) - 24576.0
    subnormal = tl.where(bits < 0, -subnormal, subnormal)  # the sign bit kept (-0.0 too), as the reference's cast keeps it
    return tl.where(a < 0.015625, subnormal, normal)


@triton.jit
def to_e4m3(x, scale, fp8_max):
    """float32 x divided by its scale (rounded to nearest), clamped to +-fp8_max and rounded to e4m3,
    still float32: every FP8 write of the kernels goes through here."""
    return round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max))


@triton.jit
def e4m3_scale(amax, fp8_max, min_scale):
    """The per-token scale of a row whose largest magnitude is amax: amax / fp8_max, at least min_scale."""
    return tl.maximum(tl.math.div_rn(amax, fp8_max), min_scale)


@triton.jit
def _quant_fp8_rows_kernel(x_ptr, q_ptr, scale_ptr, s_x, s_q, K, fp8_max, min_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_ptr + row * s_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = e4m3_scale(tl.max(amax, 0), fp8_max, min_scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_ptr + row * s_x + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = to_e4m3(x, scale, fp8_max)
        tl.store(q_ptr + row * s_q + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_tokens(x: torch.Tensor, block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (16/32-bit float, last dim contiguous) -> (q [T, K] float8_e4m3fn, scale [T, 1] float32)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_tokens takes [T, K], got shape {tuple(x.shape)}")
    check_last_dim_contiguous("x", x)
    t, k = x.shape
    q = torch.empty(t, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(t, 1, dtype=torch.float32, device=x.device)
    if t and k:
        block = min(pow2(block), pow2(k))
        _quant_fp8_rows_kernel[(t,)](x, q, scale, x.stride(0), q.stride(0), k, FP8_MAX, MIN_SCALE, BLOCK=block, num_warps=4)
    return q, scale
