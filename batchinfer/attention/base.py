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

import numpy as np
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
    # Set by the model runner for backends that ask for them (extend_tile_tokens not None), in steps
    # that are not decode-only: q rows 0..num_decode_rows-1 are one-token sequences for the decode
    # kernel, over contexts decode_seq_lens (0: padding row of a CUDA graph); extend_tiles is the
    # extend kernel's tile map (int32 [2, n], kernels.extend_attention.extend_tile_map) of the rest.
    num_decode_rows: int = 0
    decode_seq_lens: torch.Tensor | None = None
    extend_tiles: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @cached_property
    def num_leading_single(self) -> int:
        """How many sequences at the start of the batch have a one-token query. The scheduler puts a
        step's decodes first, so in a mixed step these are its decode rows (query rows 0..n-1)."""
        return leading_single_count(self.query_lens_cpu)


class AttentionBackend(Protocol):
    """Writes the new K/V into the paged cache and attends over each sequence's context."""

    name: str

    def extend_tile_tokens(self, num_heads: int, num_kv_heads: int) -> int | None:
        """Query tokens per extend tile, if the backend wants the runner to build tile maps
        (AttentionMetadata.extend_tiles); None if it does not."""
        ...

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


def leading_single_count(query_lens) -> int:
    """How many of the first query lengths are 1 (a step's decode rows come first)."""
    n = 0
    for length in query_lens:
        if length != 1:
            break
        n += 1
    return n


def extend_tile_map(query_lens, first_seq: int, block_m: int, size: int | None = None) -> np.ndarray:
    """int32 [2, n]: (sequence, query tile) of every tile of sequences first_seq.. with block_m tokens
    per tile; padded with -1 to `size` columns when given (a CUDA graph's fixed grid)."""
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
