"""The attention-backend interface between the model runner and the models.

Layout of one forward step (the model runner builds it, models pass it to every attention layer):
tokens of all sequences are packed into one flat batch of T tokens; sequence b owns the query
tokens query_start_loc[b]:query_start_loc[b+1], which are the last positions of its context
of seq_lens[b] tokens (a prefill chunk, or one decode token). Its KV lives in the paged cache
at blocks block_tables[b, :ceil(seq_lens[b]/block_size)].

KV cache per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim].
The slot of a token is block_id * block_size + offset_in_block; slot_mapping[t] is where token
t's K and V are written (-1: do not write, e.g. padding in a CUDA graph).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]
    query_start_loc: torch.Tensor  # int32 [B+1], on the device
    seq_lens: torch.Tensor  # int32 [B], context length after this step, on the device
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]  # host copies, for backends that loop on the host
    seq_lens_cpu: list[int]
    decode_only: bool  # every query length is 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def num_leading_single(self) -> int:
        """How many sequences at the start of the batch have a one-token query. The scheduler puts a
        step's decodes first, so in a mixed step these are its decode rows (query rows 0..n-1)."""
        n = 0
        for length in self.query_lens_cpu:
            if length != 1:
                break
            n += 1
        return n


class AttentionBackend(Protocol):
    """Writes the new K/V into the paged cache and attends over each sequence's context."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim], the new tokens' keys (rotary applied)
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        ...
