"""SiLU-and-mul (the gated MLP activation): out = silu(x[..., :d]) * x[..., d:].

Grid (rows, column tiles). silu is computed in float32 and rounded to the input dtype before
the product, as Hugging Face's act_fn(gate) * up does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_last_dim_contiguous, pow2


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, s_x, s_o, D, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * s_x + D + offs, mask=mask, other=0.0)
    act = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    out = act.to(tl.float32) * up.to(tl.float32)
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
