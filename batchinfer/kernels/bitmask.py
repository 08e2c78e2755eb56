"""Grammar bitmask: set the logits of disallowed tokens to -inf, in place.

Bit j of bitmask[b, i] set means token 32*i + j is allowed (structured/base.py); tokens past
the bitmask's width (logits padded beyond the tokenizer's vocabulary) are disallowed. Grid
(rows, vocab tiles); each program expands its words to bits and stores -inf only where a
token is disallowed, so an all-allowed row costs one read of its words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_last_dim_contiguous, pow2


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, s_l, s_m, V, W, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = offs < V
    words = tl.load(mask_ptr + row * s_m + offs // 32, mask=in_vocab & (offs // 32 < W), other=0)
    allowed = ((words >> (offs % 32)) & 1) != 0
    neg_inf = tl.full([BLOCK], float("-inf"), dtype=logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * s_l + offs, neg_inf, mask=in_vocab & ~allowed)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 4096) -> None:
    """logits [B, V] float, bitmask int32 [B, W]: disallowed logits become -inf in place.

    W is normally ceil(V/32); tokens at or past 32*W count as disallowed."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must be [B, V] and [B, W]")
    batch, vocab = logits.shape
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, got {bitmask.dtype}")
    check_last_dim_contiguous("logits", logits)
    check_last_dim_contiguous("bitmask", bitmask)
    if batch and vocab:
        block = min(pow2(block, 32), pow2(vocab, 32))
        _bitmask_kernel[(batch, triton.cdiv(vocab, block))](
            logits, bitmask, logits.stride(0), bitmask.stride(0), vocab, bitmask.shape[1], BLOCK=block, num_warps=4,
        )
