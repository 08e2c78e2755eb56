"""Static metadata buffers of the Triton backend's CUDA graphs, and the staging of a step into them.

A graph reads its metadata from fixed device buffers; `stage` copies a step's metadata in (device
copies only, no host sync) and pads the rest: padded token rows write no KV (slot -1), padded
sequences attend over nothing (context 0), the extend tile map is padded with -1 (no work).

DecodeBuffers: decode-only steps, one graph per batch size (the decode kernel's launch depends only
on it). MixedBuffers: steps that prefill, one graph per padded token count T: the decode kernel
over a fixed number of leading rows (min(max_seqs, T); contexts 0 past the step's decodes) and the
extend kernel over a fixed-size tile map (one tile per tile_tokens rows, plus one partial tile per
sequence).
"""

from __future__ import annotations

import torch

from batchinfer.attention.base import AttentionMetadata


class DecodeBuffers:
    """Metadata buffers for decode-only graphs of up to max_seqs rows (GraphBuffers)."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.max_seqs = max_seqs
        self.slot_mapping = torch.full((max_seqs,), -1, **i64)
        self.seq_lens = torch.zeros(max_seqs, **i32)
        self.query_start_loc = torch.arange(max_seqs + 1, **i32)
        self.block_tables = torch.zeros(max_seqs, max_blocks_per_seq, **i32)

    def meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1],  # an upper bound; the decode kernel does not read it
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[0] * size,
            decode_only=True,
        )

    def fits(self, meta: AttentionMetadata) -> bool:
        return meta.decode_only and meta.num_seqs <= self.max_seqs and meta.block_tables.shape[1] <= self.block_tables.shape[1]

    def stage(self, meta: AttentionMetadata, num_tokens: int, size: int) -> None:
        n = num_tokens
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if size > n:
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()


class MixedBuffers:
    """Metadata buffers for graphs of steps that prefill, up to max_tokens tokens of at most max_seqs
    sequences (GraphBuffers)."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, tile_tokens: int, device: torch.device) -> None:
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.max_tokens, self.max_seqs, self.tile_tokens = max_tokens, max_seqs, tile_tokens
        b = max_seqs
        self.slot_mapping = torch.full((max_tokens,), -1, **i64)
        self.query_start_loc = torch.zeros(b + 1, **i32)
        self.seq_lens = torch.zeros(b, **i32)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, **i32)
        self.decode_seq_lens = torch.zeros(b, **i32)
        self.tiles = torch.full((2, self.max_tiles(max_tokens)), -1, **i32)

    def max_tiles(self, tokens: int) -> int:
        """Extend tiles a step of `tokens` rows can need: one per tile_tokens, plus one partial tile
        per sequence."""
        return -(-tokens // self.tile_tokens) + min(self.max_seqs, tokens)

    def decode_rows(self, tokens: int) -> int:
        """Leading rows the decode kernel runs over in a graph of `tokens` rows."""
        return min(self.max_seqs, tokens)

    def meta(self, size: int) -> AttentionMetadata:
        d = self.decode_rows(size)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=size,  # not read: the tile map sets the extend grid
            max_seq_len=self.block_tables.shape[1],
            query_lens_cpu=[],  # nothing known at capture: the backend zeroes its output rows
            seq_lens_cpu=[0] * self.max_seqs,
            decode_only=False,
            num_decode_rows=d,
            decode_seq_lens=self.decode_seq_lens[:d],
            extend_tiles=self.tiles[:, : self.max_tiles(size)],
        )

    def fits(self, meta: AttentionMetadata) -> bool:
        return (
            meta.extend_tiles is not None
            and meta.num_seqs <= self.max_seqs
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def stage(self, meta: AttentionMetadata, num_tokens: int, size: int) -> None:
        n, b = num_tokens, meta.num_seqs
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:size].fill_(-1)
        # sequences past b are never read: the tile map and the decode rows name only real ones
        self.query_start_loc[: b + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        d = meta.num_decode_rows
        self.decode_seq_lens[:d].copy_(meta.decode_seq_lens, non_blocking=True)
        self.decode_seq_lens[d : self.decode_rows(size)].zero_()
        k = meta.extend_tiles.shape[1]
        if k > self.max_tiles(size):
            raise ValueError(f"{k} extend tiles do not fit the graph of {size} tokens ({self.max_tiles(size)})")
        self.tiles[:, :k].copy_(meta.extend_tiles, non_blocking=True)
        self.tiles[:, k : self.max_tiles(size)].fill_(-1)
