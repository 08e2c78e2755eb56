"""The inner loop both paged decode kernels share: one GQA group's online softmax over tokens
[start, end) of one sequence's paged KV (kernels/decode_attention.py's sequence split,
kernels/decode_balanced.py's balanced split).

Scores are in base 2 (sm_scale_log2 holds softmax's scale times log2(e), and an FP8 cache's K
scale); an FP8 cache widens exactly, via float32 (the interpreter's FP8 -> bf16 cast is wrong),
and its V scale is applied by the caller. Both shorter routes measured slower: the direct
e4m3 -> bf16 cast (0.83-0.90x on the H200) and computing in float16 (one e4m3x2 -> f16x2
conversion, the query converted once: 0.92x on an H100); BENCHMARKS.md, seventh and thirteenth
sessions. So did widening the tiles by inline PTX where they are loaded (0.93-0.99x on an H100,
eighteenth session): the cast here leaves the V tile read from shared memory a byte per
instruction (scripts/kernel_sass.py), but removing those reads does not move the FP8 cache's
decode off ~70% of the copy bandwidth. Returns (m, l, acc): the running max, the sum of
exp2(score - m) and the unnormalised output, for the caller to normalise or to merge.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_range(
    q, k_cache_ptr, v_cache_ptr, table, kv_head, start, end,
    s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, sm_scale_log2, offs_n, offs_d, mask_d,
    BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + offs_n
        mask_n = tok < end
        block = tl.load(table + tok // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        in_block = tok % BLOCK_SIZE
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(
            k_cache_ptr + (block * s_kb + in_block * s_ks + kv_head * s_kh)[:, None] + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if k.dtype != q.dtype:
            k = k.to(tl.float32).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + (block * s_vb + in_block * s_vs + kv_head * s_vh)[:, None] + offs_d[None, :],
            mask=kv_mask, other=0.0,
        )
        if v.dtype != q.dtype:
            v = v.to(tl.float32).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    return m_i, l_i, acc
