"""The Triton attention backend: KV write, then paged decode or extend attention (batchinfer.kernels).

A decode-only step (every query length 1, the CUDA-graph case) runs the split-K decode kernel,
whose launch shape depends only on the batch size and which never syncs with the host. A mixed
step runs the decode kernel on its leading one-token sequences (the scheduler puts decodes first)
and the extend kernel on the rest: prefill chunks and prefix-shared prefills. build_metadata gives
a mixed step the extend kernel's tile map (built on the host, copied with the other metadata), so
neither launch reads anything back from the device; graph_buffers (attention/triton_graphs.py)
holds the static copies CUDA graphs read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from batchinfer.attention.base import AttentionMetadata, GraphBuffers, ToDevice, leading_single_count, pack_metadata
from batchinfer.kernels.cache import reshape_and_cache
from batchinfer.kernels.decode_attention import paged_decode_attention
from batchinfer.kernels.extend_attention import extend_block_m, extend_tile_map, paged_extend_attention


@dataclass(frozen=True)
class TritonAttentionBackend:
    """AttentionBackend on Triton kernels.

    gqa_group: query heads per KV head of the model it serves (the extend tile map's tile size
        depends on it: build_metadata needs it, forward checks it);
    decode_splits: context slices per (sequence, KV head) in decode ("balanced" work: token ranges
        per KV head); None: derived from the batch size and the model's shape
        (kernels/decode_launch.launch_config; fixed per batch size, so CUDA-graph safe);
    decode_work: "sequence" or "balanced", the decode kernel's work split (kernels/decode_launch.py);
    decode_block_n / extend_block_n: keys per inner iteration; extend_block_rows: query rows
    (tokens x GQA heads) per extend program;
    kv_scale: the per-tensor scale of an FP8 KV cache (values stored as x / kv_scale, read back times
        it: engine.kv_cache_scale) for layers that give no kv_scales of their own (forward's
        (k_scale, v_scale): calibrated per layer, engine/kv_calibration.py); a cache in the model's
        dtype ignores both.
    """

    gqa_group: int = 1
    decode_splits: int | None = None
    decode_block_n: int | None = None
    decode_warps: int | None = None
    decode_stages: int | None = None
    decode_work: str = "sequence"
    extend_block_rows: int = 64
    extend_block_n: int = 64
    kv_scale: float = 1.0
    name: ClassVar[str] = "triton"
    graph_safe: ClassVar[bool] = True
    # the kernels index the cache by strides; head-major first: each (block, KV head) is one contiguous
    # run of block_size x head_dim elements for the decode kernel to stream (BENCHMARKS.md, fourteenth session)
    cache_layouts: ClassVar[tuple[str, ...]] = ("head", "token")

    @property
    def tile_tokens(self) -> int:
        """Query tokens per extend tile (AttentionMetadata.extend_tiles)."""
        return extend_block_m(self.gqa_group, self.extend_block_rows)

    def build_metadata(
        self, query_lens: np.ndarray, seq_lens: np.ndarray, block_tables: np.ndarray,
        slot_mapping: torch.Tensor, to_device: ToDevice,
    ) -> AttentionMetadata:
        """A decode-only step: the common metadata. Otherwise also the leading decode rows' count and
        contexts and the tile map of the rest, in the same host->device copy."""
        if bool((query_lens == 1).all()):
            return pack_metadata(query_lens, seq_lens, block_tables, slot_mapping, to_device)[0]
        n_dec = leading_single_count(query_lens.tolist())  # the step's decodes come first
        tiles = extend_tile_map(query_lens, n_dec, self.tile_tokens)
        meta, (flat,) = pack_metadata(query_lens, seq_lens, block_tables, slot_mapping, to_device, extra=[tiles.ravel()])
        meta.num_decode_rows = n_dec
        meta.decode_seq_lens = meta.seq_lens[:n_dec]
        meta.extend_tiles = flat.view(2, tiles.shape[1])
        return meta

    def graph_buffers(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, decode_only: bool, device: torch.device
    ) -> GraphBuffers:
        from batchinfer.attention.triton_graphs import DecodeBuffers, MixedBuffers

        if decode_only:
            return DecodeBuffers(max_seqs, max_blocks_per_seq, device)
        return MixedBuffers(max_tokens, max_seqs, max_blocks_per_seq, self.tile_tokens, device)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        if k_cache.dtype != torch.float8_e4m3fn:
            ks = vs = 1.0
        else:
            ks, vs = kv_scales if kv_scales is not None else (self.kv_scale, self.kv_scale)
        reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        if meta.decode_only and q.shape[0] == meta.seq_lens.shape[0]:
            return paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                num_splits=self.decode_splits, block_n=self.decode_block_n,
                num_warps=self.decode_warps, num_stages=self.decode_stages, k_scale=ks, v_scale=vs, work=self.decode_work,
            )
        # rows past the last sequence (padding) are never written by the kernels: zero them
        out = torch.zeros_like(q) if q.shape[0] > sum(meta.query_lens_cpu) else torch.empty_like(q)
        # A mixed step's decode rows (first in the batch) go to the split-K decode kernel; the extend
        # kernel's tile map then covers only the prefill chunks instead of hundreds of one-token
        # sequences. With a map from build_metadata both launch shapes are fixed by the buffers'
        # sizes (a mixed-step CUDA graph pads them); without one (tests, hand-built metadata) they
        # are derived here from the host copies.
        if meta.extend_tiles is None:
            n_dec, dec_lens, tiles = meta.num_leading_single, meta.seq_lens[: meta.num_leading_single], None
        else:
            if q.shape[1] != self.gqa_group * k_cache.shape[2]:
                raise ValueError(
                    f"the tile map was built for GQA groups of {self.gqa_group}, the step has "
                    f"{q.shape[1]} query heads over {k_cache.shape[2]} KV heads"
                )
            n_dec, dec_lens, tiles = meta.num_decode_rows, meta.decode_seq_lens, meta.extend_tiles
        if n_dec:
            paged_decode_attention(
                q[:n_dec], k_cache, v_cache, meta.block_tables[:n_dec], dec_lens, scale,
                num_splits=self.decode_splits, block_n=self.decode_block_n, out=out[:n_dec],
                num_warps=self.decode_warps, num_stages=self.decode_stages, k_scale=ks, v_scale=vs, work=self.decode_work,
            )
        return paged_extend_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            meta.max_query_len, scale, block_rows=self.extend_block_rows, block_n=self.extend_block_n,
            out=out, first_seq=n_dec, tiles=tiles, k_scale=ks, v_scale=vs,
        )
