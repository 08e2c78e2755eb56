"""CUDA graphs captured once at start-up: decode-only steps for a ladder of batch sizes (DecodeGraphs),
steps that prefill for a ladder of padded token counts (MixedGraphs, below).

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python the
host, not the GPU, sets the pace. Each graph replays a whole decode step (embedding, every layer,
final norm, LM head) with one launch. A graph's shapes are fixed, so a step of n sequences runs the
graph of the next ladder size >= n; the padding rows write no KV (slot -1) and attend over nothing
(seq_len 0), and their logits are dropped.

Graphs read their inputs from static device buffers (input ids, positions, slots, context lengths,
block tables); `run` copies the step's packed inputs into them, then replays. Every kernel in the
body must be graph-safe: no host syncs and launch shapes that depend on the batch size only (the
Triton decode attention uses a fixed split count for that reason).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch

from batchinfer.attention.base import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 16 below max_num_seqs, then max_num_seqs itself.

    Padding wastes at most 15 rows of a step (6% at 256); rows of a decode step cost little next to
    the weights and the KV read, so a finer ladder would buy little and cost capture time and memory.
    """
    sizes = {b for b in (1, 2, 4, 8) if b < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


def capture_largest_first(sizes: tuple[int, ...], run: Callable[[int], object]) -> tuple[dict, dict]:
    """For each size, largest first: run(size) once (a warm-up that compiles kernels outside
    capture), then capture run(size) into a CUDA graph. All graphs share one memory pool (only one
    replays at a time). Returns {size: graph} and {size: what the captured run returned}."""
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    outputs: dict[int, object] = {}
    pool = None
    for size in reversed(sizes):
        run(size)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outputs[size] = run(size)
        pool = graph.pool() if pool is None else pool
        graphs[size] = graph
    torch.cuda.synchronize()
    return graphs, outputs


def ladder_size(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of the sorted sizes that is >= n (n must not exceed the largest)."""
    return sizes[bisect.bisect_left(sizes, n)]


class DecodeGraphs:
    """One captured decode step per ladder size; `run(input_ids, positions, meta)` -> logits [n, V].

    body(input_ids, positions, meta) must run the model and return the logits of every row.
    """

    def __init__(
        self,
        body: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        device: torch.device,
    ) -> None:
        self.body = body
        self.sizes = graph_batch_sizes(max_num_seqs)
        max_bs = self.sizes[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.slot_mapping = torch.full((max_bs,), -1, **i64)
        self.seq_lens = torch.zeros(max_bs, **i32)
        self.query_start_loc = torch.arange(max_bs + 1, **i32)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.block_tables.shape[1],  # an upper bound; the decode kernel does not read it
            query_lens_cpu=[1] * bs,
            seq_lens_cpu=[0] * bs,
            decode_only=True,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per ladder size (capture_largest_first)."""
        metas = {bs: self._meta(bs) for bs in self.sizes}
        self.graphs, self.outputs = capture_largest_first(
            self.sizes, lambda bs: self.body(self.input_ids[:bs], self.positions[:bs], metas[bs])
        )

    def padded_size(self, n: int) -> int:
        """The ladder size a step of n rows runs at (n must be <= max_batch_size)."""
        return ladder_size(self.sizes, n)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Copy a packed decode step into the static buffers, replay its graph, return logits [n, V].

        The returned tensor is the graph's own output buffer: read it (sample) before the next run.
        """
        n = input_ids.shape[0]
        bs = self.padded_size(n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if bs > n:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        self.graphs[bs].replay()
        return self.outputs[bs][:n]


def mixed_graph_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token counts of the mixed-step graphs: 128, 256, 512, then every multiple of 512 up to
    max_tokens, then max_tokens itself. A step pads to the next size (at most 511 tokens, 6% of an
    8k step: padded rows cost their share of the GEMMs, and nothing in attention)."""
    sizes = {n for n in (128, 256) if n < max_tokens}
    sizes.update(range(512, max_tokens, 512))
    sizes.add(max_tokens)
    return tuple(sorted(sizes))


class MixedGraphs:
    """CUDA graphs for steps that are not decode-only (prefill chunks, with or without decode rows).

    An eager mixed step of a small model is ~400 launches from Python (31 ms of host time for
    qwen3-0.6b on an H200 host, about as long as the step's device time; BENCHMARKS.md): whatever
    else the host must do in that step (grammar masks) then comes on top. Here the step is one
    replay. Each graph is captured for a padded token count T (mixed_graph_sizes) and runs:
    the model over T rows, the decode kernel over a fixed number of leading rows (contexts of 0 for
    the rows past the step's decodes), the extend kernel over a fixed-size tile map (-1 past the
    step's tiles), and the LM head over max_num_seqs gathered rows into one shared logits buffer.
    Padded token rows write no KV (slot -1) and are never sampled.

    body(input_ids, positions, meta, sample_index, out) must run the model and the LM head into out.
    """

    def __init__(
        self,
        body,
        max_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        tile_tokens: int,
        vocab_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.body = body
        self.sizes = mixed_graph_sizes(max_tokens)
        self.max_num_seqs = max_num_seqs
        self.tile_tokens = tile_tokens
        t, b = self.sizes[-1], max_num_seqs
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(t, **i64)
        self.positions = torch.zeros(t, **i64)
        self.slot_mapping = torch.full((t,), -1, **i64)
        self.sample_index = torch.zeros(b, **i64)
        self.query_start_loc = torch.zeros(b + 1, **i32)
        self.seq_lens = torch.zeros(b, **i32)
        self.block_tables = torch.zeros(b, max_blocks_per_seq, **i32)
        self.decode_seq_lens = torch.zeros(b, **i32)
        self.tiles = torch.full((2, self.max_tiles(t)), -1, **i32)
        self.logits = torch.empty(b, vocab_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._metas = {t: self._meta(t) for t in self.sizes}

    def max_tiles(self, tokens: int) -> int:
        """Extend tiles a step of `tokens` rows can need: one per tile_tokens, plus one partial tile
        per sequence."""
        return -(-tokens // self.tile_tokens) + min(self.max_num_seqs, tokens)

    def decode_rows(self, tokens: int) -> int:
        return min(self.max_num_seqs, tokens)

    def _meta(self, t: int) -> AttentionMetadata:
        b = self.max_num_seqs
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            max_query_len=t,  # not read: the tile map sets the extend grid
            max_seq_len=self.block_tables.shape[1],
            query_lens_cpu=[],  # nothing known at capture: the backend zeroes its output rows
            seq_lens_cpu=[0] * b,
            decode_only=False,
            num_decode_rows=self.decode_rows(t),
            decode_seq_lens=self.decode_seq_lens[: self.decode_rows(t)],
            extend_tiles=self.tiles[:, : self.max_tiles(t)],
        )

    def args(self, t: int) -> tuple:
        """The body's arguments for size t: views of the static buffers."""
        return (self.input_ids[:t], self.positions[:t], self._metas[t], self.sample_index, self.logits)

    @torch.inference_mode()
    def capture(self) -> None:
        """One graph per padded size (capture_largest_first); all write the one logits buffer."""
        self.graphs, _ = capture_largest_first(self.sizes, lambda t: self.body(*self.args(t)))

    def fits(self, num_tokens: int, meta: AttentionMetadata, num_samples: int) -> bool:
        """Whether a packed step (with a tile map) can run as one of these graphs."""
        return (
            meta.extend_tiles is not None
            and num_tokens <= self.sizes[-1]
            and meta.num_seqs <= self.max_num_seqs
            and num_samples <= self.max_num_seqs
            and meta.block_tables.shape[1] <= self.block_tables.shape[1]
        )

    def stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_index: torch.Tensor) -> int:
        """Copy a packed step into the static buffers (device-side copies, no sync); returns the
        padded size t whose graph (or body(*args(t))) computes it."""
        n = input_ids.shape[0]
        t = ladder_size(self.sizes, n)
        b, s = meta.num_seqs, sample_index.shape[0]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.slot_mapping[n:t].fill_(-1)
        self.sample_index[:s].copy_(sample_index, non_blocking=True)
        self.sample_index[s:].zero_()  # stale rows could point past this size's T
        # sequences past b are never read: the tile map and the decode rows name only real ones
        self.query_start_loc[: b + 1].copy_(meta.query_start_loc, non_blocking=True)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        width = meta.block_tables.shape[1]
        self.block_tables[:b, :width].copy_(meta.block_tables, non_blocking=True)
        d = meta.num_decode_rows
        self.decode_seq_lens[:d].copy_(meta.decode_seq_lens, non_blocking=True)
        self.decode_seq_lens[d : self.decode_rows(t)].zero_()
        k = meta.extend_tiles.shape[1]
        self.tiles[:, :k].copy_(meta.extend_tiles, non_blocking=True)
        self.tiles[:, k : self.max_tiles(t)].fill_(-1)
        return t

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, sample_index: torch.Tensor) -> torch.Tensor:
        """Stage a packed step and replay the graph of its padded size; returns the logits of its
        sampling rows (the shared buffer: sample before the next run)."""
        self.graphs[self.stage(input_ids, positions, meta, sample_index)].replay()
        return self.logits[: sample_index.shape[0]]
