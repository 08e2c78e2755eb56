"""Paged decode attention with the batch's KV cut into equal token ranges ("balanced" work split).

The contexts of the batch are laid end to end (sequence 0's tokens, then sequence 1's, ...: T
tokens in all) and cut into P ranges of W = ceil(T / P) tokens. Stage 1, grid (P, KV heads):
program p walks the sequences its range [p W, (p + 1) W) touches; for each (a "piece") it runs
the GQA group's online softmax over that part of the context. A piece holding a whole sequence is
the final output and is written directly; a piece of a sequence cut by a range boundary writes a
partial output and its log-sum-exp (base 2) to slot p + i (sequence i): distinct for distinct
pieces, fewer than P + batch in all. Stage 2, grid (batch, query heads): a sequence cut into
pieces p_first..p_last merges them; a sequence within one range has nothing to do.

Why: with a fixed number of slices per sequence ("sequence" split), the longest context's slices
are the longest programs, and with few KV heads (2-4) there are too few programs to hide that
tail; here every program streams the same bytes whatever the lengths. The launch shape is (P, KV
heads) and (batch, query heads): fixed by the batch size and the model, so CUDA-graph safe; T, W
and the pieces are computed on the device from seq_lens (every program reads the lengths: a few
hundred bytes from L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_attention_inputs, dot_precision, pow2
from batchinfer.kernels.decode_range import attend_range

LOG2E = 1.4426950408889634
BLOCK_B = 128  # sequence lengths read per iteration when locating a range


@triton.jit
def _range_of(seq_lens_ptr, batch, num_ranges, MIN_W: tl.constexpr, BLOCK_B: tl.constexpr):
    """(T, W): the batch's total context and the tokens per range."""
    offs = tl.arange(0, BLOCK_B)
    total = tl.sum(tl.load(seq_lens_ptr + offs, mask=offs < batch, other=0), 0)
    for c in range(BLOCK_B, batch, BLOCK_B):
        total += tl.sum(tl.load(seq_lens_ptr + c + offs, mask=c + offs < batch, other=0), 0)
    w = tl.maximum(tl.cdiv(total, num_ranges), MIN_W)
    return total, w


@triton.jit
def _first_touched(seq_lens_ptr, batch, lo, BLOCK_B: tl.constexpr):
    """(i, start): the first sequence whose context ends after token `lo`, and where it starts."""
    offs = tl.arange(0, BLOCK_B)
    i = tl.zeros([], dtype=tl.int32)
    start = tl.zeros([], dtype=tl.int32)
    run = tl.zeros([], dtype=tl.int32)  # tokens before this chunk
    for c in range(0, batch, BLOCK_B):
        lens = tl.load(seq_lens_ptr + c + offs, mask=c + offs < batch, other=0)
        ends = run + tl.cumsum(lens, 0)
        before = (ends <= lo) & (c + offs < batch)
        i += tl.sum(before.to(tl.int32), 0)
        start += tl.sum(tl.where(before, lens, 0), 0)
        run += tl.sum(lens, 0)
    return i, start


@triton.jit(do_not_specialize=["s_bt", "batch", "num_ranges"])
def _balanced_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, mid_o_ptr, mid_lse_ptr,
    s_qb, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_bt, s_ob, s_oh, s_mk, s_mh, s_lk,
    sm_scale_log2, v_scale, batch, num_ranges,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    p = tl.program_id(0)
    kv_head = tl.program_id(1)
    total, w = _range_of(seq_lens_ptr, batch, num_ranges, BLOCK_N, BLOCK_B)
    lo = p * w
    hi = tl.minimum(lo + w, total)
    i, pos = _first_touched(seq_lens_ptr, batch, lo, BLOCK_B)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_h
    mask_hd = (offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]

    while (pos < hi) & (i < batch):
        seq_len = tl.load(seq_lens_ptr + i)
        a = tl.maximum(lo, pos) - pos  # this piece: tokens [a, e) of sequence i
        e = tl.minimum(hi, pos + seq_len) - pos
        if a < e:
            b64 = i.to(tl.int64)
            q = tl.load(q_ptr + b64 * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=mask_hd, other=0.0)
            m_i, l_i, acc = attend_range(
                q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b64 * s_bt, kv_head, a, e,
                s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, sm_scale_log2, offs_n, offs_d, offs_d < HEAD_DIM,
                BLOCK_SIZE, BLOCK_H, BLOCK_D, BLOCK_N, DOT_PREC,
            )
            out = acc * v_scale / l_i[:, None]
            if (a == 0) & (e == seq_len):  # the whole sequence: the final output
                tl.store(out_ptr + b64 * s_ob + heads[:, None] * s_oh + offs_d[None, :],
                         out.to(out_ptr.dtype.element_ty), mask=mask_hd)
            else:
                k_slot = (p + i).to(tl.int64)
                tl.store(mid_o_ptr + k_slot * s_mk + heads[:, None] * s_mh + offs_d[None, :], out, mask=mask_hd)
                tl.store(mid_lse_ptr + k_slot * s_lk + heads, m_i + tl.log2(l_i), mask=offs_h < GROUP)
        pos += seq_len
        i += 1


@triton.jit(do_not_specialize=["batch", "num_ranges"])
def _balanced_merge_kernel(
    seq_lens_ptr, mid_o_ptr, mid_lse_ptr, out_ptr, s_mk, s_mh, s_lk, s_ob, s_oh, batch, num_ranges,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MIN_W: tl.constexpr, BLOCK_B: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    seq_len = tl.load(seq_lens_ptr + b)
    out_row = out_ptr + b.to(tl.int64) * s_ob + h * s_oh + offs_d
    if seq_len == 0:  # padding: a zero row
        tl.store(out_row, tl.zeros([BLOCK_D], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=mask_d)
    else:
        total, w = _range_of(seq_lens_ptr, batch, num_ranges, MIN_W, BLOCK_B)
        offs = tl.arange(0, BLOCK_B)
        start = tl.zeros([], dtype=tl.int32)
        for c in range(0, batch, BLOCK_B):
            start += tl.sum(tl.load(seq_lens_ptr + c + offs, mask=c + offs < b, other=0), 0)
        p_first = start // w
        p_last = (start + seq_len - 1) // w
        if p_first < p_last:  # cut by a range boundary (else stage 1 wrote the output)
            m = tl.full([], float("-inf"), dtype=tl.float32)
            wsum = tl.zeros([], dtype=tl.float32)
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for p in range(p_first, p_last + 1):
                k_slot = (p + b).to(tl.int64)
                lse = tl.load(mid_lse_ptr + k_slot * s_lk + h)
                o = tl.load(mid_o_ptr + k_slot * s_mk + h * s_mh + offs_d, mask=mask_d, other=0.0)
                m_new = tl.maximum(m, lse)
                scale_old = tl.exp2(m - m_new)
                wk = tl.exp2(lse - m_new)
                acc = acc * scale_old + wk * o
                wsum = wsum * scale_old + wk
                m = m_new
            tl.store(out_row, (acc / wsum).to(out_ptr.dtype.element_ty), mask=mask_d)


def balanced_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]; 0 gives a zero output row (padding)
    scale: float,
    num_ranges: int,
    block_n: int,
    out: torch.Tensor,
    num_warps: int = 4,
    num_stages: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """decode_attention.paged_decode_attention with the "balanced" work split: `num_ranges` equal
    token ranges per KV head (see the module docstring)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, group = check_attention_inputs(q, k_cache, v_cache)
    if seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 (the kernels sum them in int32), not {seq_lens.dtype}")
    slots = num_ranges + batch  # piece (range p, sequence i) -> slot p + i
    mid_o = torch.empty(slots, num_heads, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(slots, num_heads, dtype=torch.float32, device=q.device)
    block_d = pow2(head_dim, 16)
    _balanced_split_kernel[(num_ranges, num_kv_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, out, mid_o, mid_lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0),
        scale * LOG2E * k_scale, v_scale, batch, num_ranges,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=pow2(group, 16), BLOCK_D=block_d, BLOCK_N=block_n, DOT_PREC=dot_precision(q.dtype),
        BLOCK_B=BLOCK_B, num_warps=num_warps, num_stages=num_stages,
    )
    _balanced_merge_kernel[(batch, num_heads)](
        seq_lens, mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_lse.stride(0),
        out.stride(0), out.stride(1), batch, num_ranges,
        HEAD_DIM=head_dim, BLOCK_D=block_d, MIN_W=block_n, BLOCK_B=BLOCK_B, num_warps=1,
    )
    return out
