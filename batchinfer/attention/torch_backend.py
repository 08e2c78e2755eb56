"""Plain PyTorch attention over the paged KV cache: the CPU backend and the reference for GPU kernels.

For each step it (1) scatters the new tokens' K/V into the cache at meta.slot_mapping (slots < 0 are
skipped), then (2) for each sequence gathers its context from its blocks and runs
scaled_dot_product_attention with the query rows aligned to the END of the context: query i of a
chunk of q tokens in a context of s tokens sits at position s - q + i and sees keys 0..s - q + i.
That one rule covers full prefill, chunked prefill, prefix-shared prefill and decode, mixed freely
in one batch. It loops over sequences on the host, which is fine for a reference, not for speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import numpy as np

from batchinfer.attention.base import AttentionMetadata, GraphBuffers, ToDevice, pack_metadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Copy k/v [T, kv_heads, head_dim] into the caches at slots [T]; slots < 0 are not written."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence: [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len]


class TorchAttentionBackend:
    """AttentionBackend in plain PyTorch (any device; used on CPU)."""

    name = "torch"
    graph_safe = False  # loops over sequences on the host (query_lens_cpu): nothing to capture

    def build_metadata(
        self, query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
        slot_mapping: torch.Tensor, to_device: ToDevice,
    ) -> AttentionMetadata:
        return pack_metadata(query_lens, seq_lens, block_tables, slot_mapping, to_device)[0]

    def graph_buffers(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, decode_only: bool, device) -> GraphBuffers:
        raise NotImplementedError("the torch attention backend is not graph-safe (it loops on the host)")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.zeros_like(q)
        group = q.shape[1] // k_cache.shape[2]
        start = 0
        for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len == 0:
                continue
            if q_len > seq_len:
                raise ValueError(f"sequence {b}: query_len {q_len} exceeds seq_len {seq_len}")
            keys = gather_context(k_cache, meta.block_tables[b], seq_len)
            values = gather_context(v_cache, meta.block_tables[b], seq_len)
            if group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            query = q[start : start + q_len].transpose(0, 1)  # [heads, q_len, head_dim]
            mask = None
            if q_len > 1:
                rows = torch.arange(q_len, device=q.device)[:, None] + (seq_len - q_len)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            attended = F.scaled_dot_product_attention(
                query, keys.transpose(0, 1).to(q.dtype), values.transpose(0, 1).to(q.dtype), attn_mask=mask, scale=scale
            )
            out[start : start + q_len] = attended.transpose(0, 1)
            start += q_len
        return out
