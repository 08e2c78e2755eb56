"""Test helper: paged KV caches and AttentionMetadata for hand-made steps, independent of the engine.

PagedSequences hands out blocks from a shuffled pool (so block tables are non-contiguous), tracks each
sequence's context length, and turns one step — a list of (sequence, new token ids) chunks — into the
packed input_ids, positions and AttentionMetadata a model or attention backend takes. `share_prefix`
makes a new sequence reuse the full blocks of another's prefix (prefix sharing), so only its
remaining tokens are computed.
"""

from __future__ import annotations

import random

import torch

from batchinfer.attention.base import AttentionMetadata


def make_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype=torch.float32):
    """Per-layer (k_cache, v_cache), filled with NaN so a read of an unwritten slot poisons the output."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)) for _ in range(num_layers)]


class PagedSequences:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.blocks: list[list[int]] = []
        self.lengths: list[int] = []

    def add(self) -> int:
        """A new empty sequence; returns its index."""
        self.blocks.append([])
        self.lengths.append(0)
        return len(self.blocks) - 1

    def share_prefix(self, source: int, num_tokens: int) -> int:
        """A new sequence whose first num_tokens (a multiple of block_size) are source's cached tokens."""
        assert num_tokens % self.block_size == 0 and num_tokens <= self.lengths[source]
        idx = self.add()
        self.blocks[idx] = self.blocks[source][: num_tokens // self.block_size]
        self.lengths[idx] = num_tokens
        return idx

    def _slot(self, seq: int, position: int) -> int:
        block_index, offset = divmod(position, self.block_size)
        while len(self.blocks[seq]) <= block_index:
            self.blocks[seq].append(self.free.pop())
        return self.blocks[seq][block_index] * self.block_size + offset

    def step(self, chunks: list[tuple[int, list[int]]]):
        """(input_ids, positions, meta) for one step; advances the sequences' lengths."""
        ids, positions, slots, query_lens, seq_lens, tables = [], [], [], [], [], []
        for seq, tokens in chunks:
            start = self.lengths[seq]
            for i, token in enumerate(tokens):
                ids.append(token)
                positions.append(start + i)
                slots.append(self._slot(seq, start + i))
            self.lengths[seq] = start + len(tokens)
            query_lens.append(len(tokens))
            seq_lens.append(self.lengths[seq])
            tables.append(list(self.blocks[seq]))
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            decode_only=all(n == 1 for n in query_lens),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta


def compare_backends_over_steps(first, second, caches_first, caches_second, num_heads: int, num_kv_heads: int,
                                head_dim: int, block_size: int) -> AttentionMetadata:
    """Two attention backends, each on its own (k_cache, v_cache), through one script of steps: a
    prefill of two sequences, a chunked prefill, a third sequence sharing the first's 3 full blocks
    next to decodes, then decode steps. Their outputs must agree at every step (rtol 1e-4, atol 1e-5);
    returns the last step's metadata (a decode-only step)."""
    (kc_a, vc_a), (kc_b, vc_b) = caches_first, caches_second
    seqs = PagedSequences(kc_a.shape[0], block_size, seed=3)
    a, b = seqs.add(), seqs.add()
    gen = torch.Generator().manual_seed(0)
    steps = [[(a, [1] * 13), (b, [1] * 6)], [(a, [1] * 3), (b, [1] * 9)]]  # prefill, then chunks
    for step in range(5):
        if step < len(steps):
            chunks = steps[step]
        elif step == len(steps):
            c = seqs.share_prefix(a, 12)  # a's first 3 blocks, shared
            chunks = [(a, [1]), (b, [1]), (c, [1] * 5)]
        else:
            chunks = [(s, [1]) for s in (a, b, c)]
        _, _, meta = seqs.step(chunks)
        tokens = meta.slot_mapping.shape[0]
        q = torch.randn(tokens, num_heads, head_dim, generator=gen)
        k = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
        got = first.forward(q, k, v, kc_a, vc_a, meta, 0.25)
        want = second.forward(q, k, v, kc_b, vc_b, meta, 0.25)
        assert torch.isfinite(got).all(), f"step {step}"
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"step {step}")
    return meta
