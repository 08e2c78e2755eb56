"""Plain-PyTorch references of every Triton kernel in this package.

They define the math each kernel must reproduce (tests compare the two) and they are what
`batchinfer.kernels.ops` runs when there is no CUDA device. They favour clarity over speed:
attention loops over sequences on the host.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # the largest finite float8_e4m3fn
FP8_MIN_SCALE = 1e-12  # a row of zeros gets this scale instead of 0 (its values quantise to 0 either way)


def reshape_and_cache(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int [T]; slot < 0 means "do not write"
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write each token's K and V into its cache slot (block_id * block_size + offset); into an FP8
    cache as to_kv_cache(k, k_scale) (divided by the scale, saturated, rounded to nearest)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_kv_cache(k[keep], k_cache.dtype, k_scale)
    v_cache[blocks, offsets] = to_kv_cache(v[keep], v_cache.dtype, v_scale)


def to_kv_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Values as a KV cache of `dtype` stores them: FP8 (float8_e4m3fn) holds x / scale saturated
    at +-448; any other dtype holds x itself (scale unused)."""
    if dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)


def from_kv_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Cached values read back in `dtype`: an FP8 cache's times its scale."""
    if x.dtype != torch.float8_e4m3fn:
        return x.to(dtype)
    return x.to(dtype) * scale


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence's K or V: [seq_len, Hkv, D]."""
    block_size = cache.shape[1]
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache[block_table[:n_blocks].long()]  # [n, bs, Hkv, D]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [B, max_blocks]
    seq_lens: torch.Tensor,  # int [B]
    query_start_loc: torch.Tensor,  # int [B+1]
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each sequence's query tokens (its LAST query_len positions) over its
    whole context in the paged cache. Covers decode (query_len 1) and prefill/extend alike.
    Computed in float32, returned in q's dtype; GQA: query head h reads KV head h // (Hq // Hkv).
    An FP8 cache's values are read times k_scale / v_scale (from_kv_cache).
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_lo, q_hi = starts[b], starts[b + 1]
        query_len = q_hi - q_lo
        if query_len == 0 or seq_len == 0:
            continue
        keys = from_kv_cache(_gather_context(k_cache, block_tables[b], seq_len), torch.float32, k_scale)
        values = from_kv_cache(_gather_context(v_cache, block_tables[b], seq_len), torch.float32, v_scale)
        keys = keys.repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        qs = q[q_lo:q_hi].float()  # [L, Hq, D]
        scores = torch.einsum("lhd,shd->hls", qs, keys) * scale
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[q_lo:q_hi] = torch.einsum("hls,shd->lhd", probs, values).to(q.dtype)
    return out


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Decode attention: paged_attention with one query token per sequence."""
    qsl = torch.arange(q.shape[0] + 1, dtype=torch.int32)
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, qsl, scale, k_scale, v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, as Hugging Face Llama computes it: normalise in float32, round to
    x's dtype, then multiply by the weight."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """new_residual = x + residual (in x's dtype); returns (rms_norm(new_residual), new_residual)."""
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def apply_rotary(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # int [T]
    cos_cache: torch.Tensor,  # [max_pos, R/2], R = rotary dim <= D
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary embedding on the first R dims of every head, out of place.
    Computed in float32 and rounded to the input dtype once."""
    cos = cos_cache[positions.long()].float().unsqueeze(1)  # [T, 1, R/2]
    sin = sin_cache[positions.long()].float().unsqueeze(1)
    half = cos_cache.shape[-1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half : 2 * half]
        out = x.clone()
        out[..., :half] = (x1 * cos - x2 * sin).to(x.dtype)
        out[..., half : 2 * half] = (x2 * cos + x1 * sin).to(x.dtype)
        return out

    return rotate(q), rotate(k)


def rotary_cos_sin(
    max_positions: int, rotary_dim: int, base: float = 10000.0, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 cos/sin caches [max_positions, rotary_dim/2] of plain (unscaled) rotary."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    return freqs.cos(), freqs.sin()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x[..., :d] -> silu, times x[..., d:]; silu rounded to x's dtype before the product (as HF)."""
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set logits[b, t] = -inf where bit t % 32 of bitmask[b, t // 32] is clear (in place);
    tokens past the bitmask's width are disallowed."""
    vocab = logits.shape[-1]
    tokens = torch.arange(vocab, device=logits.device)
    word_index = tokens // 32
    inside = word_index < bitmask.shape[1]
    words = bitmask[:, word_index.clamp(max=bitmask.shape[1] - 1)].long()
    allowed = ((words >> (tokens % 32)) & 1).bool() & inside
    logits.masked_fill_(~allowed, float("-inf"))



def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] -> (float8_e4m3fn [R, C], scale [R] float32), one scale a row: scale = amax(|row|) / 448,
    q = x / scale rounded to nearest (every row's largest value maps to +-448)."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=-1) / FP8_MAX).clamp_(min=FP8_MIN_SCALE)
    q = (x32 / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_fp8_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [T, K] -> (float8_e4m3fn [T, K], scale [T, 1] float32): per-token quantize_fp8_rows."""
    q, scale = quantize_fp8_rows(x)
    return q, scale.unsqueeze(-1)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm then per-token FP8: (float8_e4m3fn [T, N], scale [T, 1] float32)."""
    return quantize_fp8_tokens(rms_norm(x, weight, eps))


def fused_add_rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    """((FP8, scale) of rms_norm(x + residual), x + residual)."""
    normed, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    return quantize_fp8_tokens(normed), new_residual


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul then per-token FP8: [T, 2d] -> (float8_e4m3fn [T, d], scale [T, 1] float32)."""
    return quantize_fp8_tokens(silu_and_mul(x))
