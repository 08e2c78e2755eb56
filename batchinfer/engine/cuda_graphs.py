"""CUDA graphs for decode-only steps: captured once at start-up for a ladder of batch sizes.

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
        """Capture the largest size first; all graphs share one memory pool (only one runs at a time)."""
        pool = None
        for bs in reversed(self.sizes):
            meta = self._meta(bs)
            self.body(self.input_ids[:bs], self.positions[:bs], meta)  # warm-up: compiles kernels outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.body(self.input_ids[:bs], self.positions[:bs], meta)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
            self.outputs[bs] = out
        torch.cuda.synchronize()

    def padded_size(self, n: int) -> int:
        """The ladder size a step of n rows runs at (n must be <= max_batch_size)."""
        return self.sizes[bisect.bisect_left(self.sizes, n)]

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
