"""The Triton attention backend: KV write, then paged decode or extend attention (batchinfer.kernels).

A decode-only step (every query length 1, the CUDA-graph case) runs the split-K decode kernel,
whose launch shape depends only on the batch size and which never syncs with the host. A mixed
step runs the decode kernel on its leading one-token sequences (the scheduler puts decodes first)
and the extend kernel on the rest: prefill chunks and prefix-shared prefills.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from batchinfer.attention.base import AttentionMetadata
from batchinfer.kernels.cache import reshape_and_cache
from batchinfer.kernels.decode_attention import paged_decode_attention
from batchinfer.kernels.extend_attention import extend_block_m, paged_extend_attention


@dataclass(frozen=True)
class TritonAttentionBackend:
    """AttentionBackend on Triton kernels.

    decode_splits: context slices per (sequence, KV head) in decode; None: chosen from the batch
        size (kernels.decode_attention.decode_splits; fixed per batch size, so CUDA-graph safe);
    decode_block_n / extend_block_n: keys per inner iteration; extend_block_rows: query rows
    (tokens x GQA heads) per extend program.
    """

    decode_splits: int | None = None
    decode_block_n: int | None = None
    decode_warps: int = 4
    decode_stages: int | None = None
    extend_block_rows: int = 64
    extend_block_n: int = 64
    name: ClassVar[str] = "triton"

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
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only and q.shape[0] == meta.seq_lens.shape[0]:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                num_splits=self.decode_splits, block_n=self.decode_block_n,
                num_warps=self.decode_warps, num_stages=self.decode_stages,
            )
        # rows past the last sequence (padding) are never written by the kernels: zero them
        out = torch.zeros_like(q) if q.shape[0] > sum(meta.query_lens_cpu) else torch.empty_like(q)
        # A mixed step's decode rows (first in the batch) go to the split-K decode kernel; the extend
        # kernel's tile map then covers only the prefill chunks instead of hundreds of one-token
        # sequences. With a map from the runner both launch shapes are fixed by the buffers' sizes
        # (a mixed-step CUDA graph pads them); without one (tests, hand-built metadata) they are
        # derived here from the host copies.
        if meta.extend_tiles is None:
            n_dec, dec_lens, tiles = meta.num_leading_single, meta.seq_lens[: meta.num_leading_single], None
        else:
            n_dec, dec_lens, tiles = meta.num_decode_rows, meta.decode_seq_lens, meta.extend_tiles
        if n_dec:
            paged_decode_attention(
                q[:n_dec], k_cache, v_cache, meta.block_tables[:n_dec], dec_lens, scale,
                num_splits=self.decode_splits, block_n=self.decode_block_n, out=out[:n_dec],
                num_warps=self.decode_warps, num_stages=self.decode_stages,
            )
        return paged_extend_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, scale, block_rows=self.extend_block_rows, block_n=self.extend_block_n,
            out=out, first_seq=n_dec, tiles=tiles,
        )

    def extend_tile_tokens(self, num_heads: int, num_kv_heads: int) -> int | None:
        return extend_block_m(num_heads // num_kv_heads, self.extend_block_rows)
