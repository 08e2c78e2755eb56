"""Prefill / extend attention over the paged KV cache.

Sequence b has query_len = query_start_loc[b+1] - query_start_loc[b] new tokens, the LAST
query_len positions of a context of seq_lens[b] tokens. Their K/V were already written to the
cache (reshape_and_cache), so every key, whether from a shared prefix, an earlier chunk or this
step, is read from the cache through the block table.

Grid (tiles, kv_heads), with a tile map: tile i is query tile tiles[1, i] of sequence tiles[0, i]
(-1: no work, so a CUDA graph can launch a fixed grid sized for its largest step). The map lists only
the sequences the caller wants (a mixed step's prefill chunks, not its decode rows) and no empty tiles.
A program owns BLOCK_M query tokens times all GROUP query heads of one KV head, flattened into the
BLOCK_M * GROUP leading rows of a ROWS-row tl.dot (ROWS a power of two; the group itself is not padded,
so a group of 6 fills 60 of 64 rows with 10 tokens, not 48 with 8), so each KV tile is loaded once
per GQA group. Keys before the tile's first query position need no causal mask and
are visited in a mask-free loop; only the last stretch applies the causal/length mask.
Online softmax in base 2, float32 accumulators.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from batchinfer.kernels._util import check_attention_inputs, dot_precision, pow2

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc, m_i, l_i, q, tok, block, in_block, kv_head, q_pos, seq_len,
    k_cache_ptr, v_cache_ptr, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, offs_d, sm_scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """One BLOCK_N tile of keys: update the running max, sum and output."""
    k_off = (block * s_kb + in_block * s_ks + kv_head * s_kh)[:, None] + offs_d[None, :]
    v_off = (block * s_vb + in_block * s_vs + kv_head * s_vh)[:, None] + offs_d[None, :]
    if MASKED:
        kv_mask = (tok < seq_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_cache_ptr + k_off, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + v_off, mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_cache_ptr + k_off, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_cache_ptr + v_off, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)
    else:
        k = tl.load(k_cache_ptr + k_off)
        v = tl.load(v_cache_ptr + v_off)
    # an FP8 cache widens exactly (its K scale is in sm_scale_log2, its V scale applied at the end), via
    # float32 because the interpreter's FP8 -> bf16 cast is wrong
    if k.dtype != q.dtype:
        k = k.to(tl.float32).to(q.dtype)
        v = v.to(tl.float32).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
    if MASKED:
        visible = (tok[None, :] <= q_pos[:, None]) & (tok[None, :] < seq_len)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row with every key masked so far keeps m = -inf; use 0 so exp2 gives 0, not nan
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i


# the block-table width and the tile count change every step: not specialised on, no recompiles
@triton.jit(do_not_specialize=["s_bt", "s_tiles"])
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, qsl_ptr, tiles_ptr,
    s_qt, s_qh, s_ot, s_oh,
    s_kb, s_ks, s_kh, s_vb, s_vs, s_vh,
    s_bt, s_tiles,
    sm_scale_log2, v_scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.load(tiles_ptr + pid)
    if b < 0:
        return
    tile = tl.load(tiles_ptr + s_tiles + pid)

    q_start = tl.load(qsl_ptr + b)
    query_len = tl.load(qsl_ptr + b + 1) - q_start
    m_start = tile * BLOCK_M
    if m_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_len = seq_len - query_len  # tokens before the first query token

    # rows = (query token, head in group), head fastest
    rows = tl.arange(0, ROWS)
    m_idx = m_start + rows // GROUP
    g_idx = rows % GROUP
    row_ok = (rows < BLOCK_M * GROUP) & (m_idx < query_len)
    heads = kv_head * GROUP + g_idx
    q_pos = ctx_len + m_idx
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < HEAD_DIM
    t_idx = (q_start + m_idx).to(tl.int64)

    q = tl.load(
        q_ptr + t_idx[:, None] * s_qt + heads[:, None] * s_qh + offs_d[None, :],
        mask=row_ok[:, None] & mask_d[None, :], other=0.0,
    )
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * s_bt

    # keys every row of the tile sees, in whole tiles: no mask
    free_end = ((ctx_len + m_start) // BLOCK_N) * BLOCK_N
    for n0 in range(0, free_end, BLOCK_N):
        tok = n0 + offs_n
        block = tl.load(table + tok // BLOCK_SIZE).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, tok, block, tok % BLOCK_SIZE, kv_head, q_pos, seq_len,
            k_cache_ptr, v_cache_ptr, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, offs_d, sm_scale_log2,
            HEAD_DIM, BLOCK_D, False, DOT_PREC,
        )
    # the causal stretch: up to the tile's last query position
    kv_end = tl.minimum(ctx_len + m_start + BLOCK_M, seq_len)
    for n0 in range(free_end, kv_end, BLOCK_N):
        tok = n0 + offs_n
        block = tl.load(table + tok // BLOCK_SIZE, mask=tok < seq_len, other=0).to(tl.int64)
        acc, m_i, l_i = _attend_tile(
            acc, m_i, l_i, q, tok, block, tok % BLOCK_SIZE, kv_head, q_pos, seq_len,
            k_cache_ptr, v_cache_ptr, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, offs_d, sm_scale_log2,
            HEAD_DIM, BLOCK_D, True, DOT_PREC,
        )

    out = acc * v_scale / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + t_idx[:, None] * s_ot + heads[:, None] * s_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :],
    )


def extend_block_m(group: int, block_rows: int = 64) -> int:
    """Query tokens per extend tile for a GQA group size: as many as fit block_rows rows (tokens x
    the group's heads; block_rows rounded up to a power of two, at least 16), at least one."""
    return max(max(pow2(block_rows), 16) // group, 1)


def extend_rows(group: int, block_m: int) -> int:
    """The kernel's tl.dot rows for block_m tokens of a GQA group: a power of two, at least 16."""
    return pow2(block_m * group, 16)


def extend_tile_map(query_lens, first_seq: int, block_m: int, size: int | None = None) -> np.ndarray:
    """The kernel's work list: int32 [2, n], (sequence, query tile) of every tile of sequences
    first_seq.. with block_m tokens per tile; padded with -1 to `size` columns when given (a CUDA
    graph's fixed grid). Built on the host (the attention backend copies it with the step's other
    metadata), so the launch needs nothing read back from the device."""
    lens = np.asarray(query_lens, dtype=np.int64)[first_seq:]
    counts = -(-lens // block_m)
    n = int(counts.sum())
    width = n if size is None else size
    if width < n:
        raise ValueError(f"{n} extend tiles do not fit a map of {size}")
    tiles = np.full((2, width), -1, dtype=np.int32)
    seq = np.repeat(np.arange(first_seq, first_seq + len(lens)), counts)
    starts = np.cumsum(counts) - counts
    tiles[0, :n] = seq
    tiles[1, :n] = np.arange(n) - np.repeat(starts, counts)
    return tiles


def paged_extend_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int32 [B]
    query_start_loc: torch.Tensor,  # int32 [B+1]
    max_query_len: int,
    scale: float,
    block_rows: int = 64,
    block_n: int = 64,
    out: torch.Tensor | None = None,
    first_seq: int = 0,
    num_warps: int = 4,
    num_stages: int = 2,
    tiles: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its whole paged context.

    k_scale, v_scale: what the cached values are multiplied by when read (an FP8 cache's per-tensor
    scales; 1.0 for a cache in the model's dtype).

    block_rows: query rows (tokens x heads of a GQA group) per program, >= 16 and a power of two;
    block_n: keys per inner iteration (multiple of 16).
    tiles: int32 [2, n] on the device from extend_tile_map(query lens, first_seq,
    extend_block_m(group, block_rows)): the work to do; the grid is n x KV heads whatever the map
    holds, so it can be captured in a CUDA graph. None: built here for sequences first_seq.. (reads
    query_start_loc back to the host). Rows of `out` that no tile covers are left as they are (a
    mixed step's decode rows, which the decode kernel computes). max_query_len is only read when
    there is no map (0 means no work).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, group = check_attention_inputs(q, k_cache, v_cache)
    if out is None:
        out = torch.empty_like(q)
    block_m = extend_block_m(group, block_rows)
    if tiles is None:
        if num_tokens == 0 or max_query_len == 0 or seq_lens.shape[0] <= first_seq:
            return out
        qsl = query_start_loc.cpu().numpy().astype(np.int64)
        tiles = torch.from_numpy(extend_tile_map(np.diff(qsl), first_seq, block_m)).to(q.device)
    if tiles.dim() != 2 or tiles.shape[0] != 2 or tiles.dtype != torch.int32 or tiles.stride(1) != 1:
        raise ValueError(f"tiles must be a row-major int32 [2, n] tile map, got {tiles.dtype} {tuple(tiles.shape)}")
    if tiles.shape[1] == 0 or num_tokens == 0:
        return out
    _extend_kernel[(tiles.shape[1], num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), tiles.stride(0),
        scale * LOG2E * k_scale, v_scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, ROWS=extend_rows(group, block_m), BLOCK_N=block_n, BLOCK_D=pow2(head_dim, 16),
        DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
