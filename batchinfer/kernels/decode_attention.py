"""Paged-KV decode attention (flash-decoding): one query token per sequence.

Stage 1, grid (batch, kv_heads, NUM_SPLITS): each program takes ONE KV head and all the query
heads that share it (GQA group, padded to >= 16 rows so tl.dot maps onto tensor cores), and one
contiguous slice of the context. Every KV tile is therefore loaded once per group, not once per
query head. It writes a partial output and its log-sum-exp (base 2) per split.
Stage 2, grid (batch, q_heads): merges the splits with their log-sum-exps.

Splitting the context keeps the GPU busy when the batch is small and contexts are long. The
split count is a constexpr and empty splits exit early, so the launch shape depends only on
the batch size: no host syncs, safe to capture in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_attention_inputs, dot_precision, pow2
from batchinfer.kernels.decode_balanced import balanced_decode_attention
from batchinfer.kernels.decode_launch import DecodeLaunch, launch_config
from batchinfer.kernels.decode_range import attend_range

LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["s_bt", "num_splits"])  # may change between eager steps: no recompiles
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    s_qb, s_qh,
    s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
    s_bt,
    s_mb, s_mh, s_ms,
    s_lb, s_lh,
    sm_scale_log2, v_scale, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    b64 = b.to(tl.int64)

    q = tl.load(
        q_ptr + b64 * s_qb + heads[:, None] * s_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :], other=0.0,
    )
    m_i, l_i, acc = attend_range(
        q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b64 * s_bt, kv_head, start, end,
        s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, sm_scale_log2, offs_n, offs_d, mask_d,
        BLOCK_SIZE, BLOCK_H, BLOCK_D, BLOCK_N, DOT_PREC,
    )

    has = l_i > 0.0
    out = acc * v_scale / tl.where(has, l_i, 1.0)[:, None]
    if DIRECT:  # one split: this is the final output (mid_o_ptr is the output, s_ms unused)
        tl.store(
            mid_o_ptr + b64 * s_mb + heads[:, None] * s_mh + offs_d[None, :],
            out.to(mid_o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :],
        )
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(
            mid_o_ptr + b64 * s_mb + heads[:, None] * s_mh + split * s_ms + offs_d[None, :],
            out, mask=mask_h[:, None] & mask_d[None, :],
        )
        tl.store(mid_lse_ptr + b64 * s_lb + heads * s_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    s_mb, s_mh, s_ms, s_lb, s_lh, s_ob, s_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b * s_lb + h * s_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)  # 0 for empty splits
    o = tl.load(
        mid_o_ptr + b * s_mb + h * s_mh + offs_s[:, None] * s_ms + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :], other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=mask_d)


def _sm_count(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


def decode_launch(q: torch.Tensor, k_cache: torch.Tensor, work: str = "sequence") -> DecodeLaunch:
    """The launch config for this call's shape (kernels/decode_launch.launch_config): a function of
    the batch size, the model's heads and head_dim, the cache dtype and the GPU, never of the lengths."""
    batch, num_heads, head_dim = q.shape
    return launch_config(batch, num_heads, k_cache.shape[2], head_dim, k_cache.element_size(), _sm_count(q.device), work)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]; 0 gives a zero output row (padding)
    scale: float,
    num_splits: int | None = None,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    work: str = "sequence",
) -> torch.Tensor:
    """Attention of each sequence's single query token over its whole paged context.

    k_scale, v_scale: what the cached values are multiplied by when read (an FP8 cache's per-tensor
    scales; 1.0 for a cache in the model's dtype).

    work: "sequence" (each sequence's context cut into num_splits slices) or "balanced" (the
    batch's contexts cut into num_splits equal token ranges per KV head: kernels/decode_balanced.py).
    num_splits: slices per (sequence, KV head), or ranges per KV head; fixed for a batch size (the
    launch shape never depends on sequence lengths). With one "sequence" split the kernel writes
    the output itself and the merge kernel is skipped.
    block_n: context tokens per inner iteration (multiple of 16). Every launch parameter left None
    comes from the shape (decode_launch: kernels/decode_launch.py has the rule and its data).
    """
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group = check_attention_inputs(q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if None in (num_splits, block_n, num_warps, num_stages):
        launch = decode_launch(q, k_cache, work)
        num_splits = launch.splits if num_splits is None else num_splits
        block_n = launch.block_n if block_n is None else block_n
        num_warps = launch.num_warps if num_warps is None else num_warps
        num_stages = launch.num_stages if num_stages is None else num_stages
    if work == "balanced":
        return balanced_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, block_n, out,
                                         num_warps, num_stages, k_scale, v_scale)
    if work != "sequence":
        raise ValueError(f"decode work split must be 'sequence' or 'balanced', not {work!r}")
    direct = num_splits == 1
    if direct:
        mid_o, mid_lse = out, out  # written directly; mid_lse unused
        s_mo = (out.stride(0), out.stride(1), 0)
        s_ml = (0, 0)
    else:
        mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
        s_mo = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2))
        s_ml = (mid_lse.stride(0), mid_lse.stride(1))
    block_d = pow2(head_dim, 16)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        *s_mo, *s_ml,
        scale * LOG2E * k_scale, v_scale, num_splits,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=pow2(group, 16), BLOCK_D=block_d, BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype),
        DIRECT=direct, num_warps=num_warps, num_stages=num_stages,
    )
    if direct:
        return out
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=pow2(num_splits), BLOCK_D=block_d,
        num_warps=4,
    )
    return out
