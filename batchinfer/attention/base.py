"""The attention-backend interface between the model runner and the models: step metadata, graph buffers.

Layout of one forward step (the backend builds it from the runner's host arrays, models pass it to
every attention layer): tokens of all sequences are packed into one flat batch of T tokens;
sequence b owns the query tokens query_start_loc[b]:query_start_loc[b+1], which are the last
positions of its context of seq_lens[b] tokens (a prefill chunk, or one decode token). Its KV lives
in the paged cache at blocks block_tables[b, :ceil(seq_lens[b]/block_size)].

KV cache per layer: k_cache, v_cache of shape [num_blocks, block_size, num_kv_heads, head_dim], in
memory either that way or head-major ([num_blocks, num_kv_heads, block_size, head_dim] seen through
strides: engine/kv_cache.KV_LAYOUTS); a backend lists the layouts it reads in `cache_layouts`.
The slot of a token is block_id * block_size + offset_in_block; slot_mapping[t] is where token
t's K and V are written (-1: do not write, e.g. padding in a CUDA graph).

A backend owns everything about its metadata: `build_metadata` turns a step's host arrays into an
AttentionMetadata (with whatever extra fields its kernels read), `graph_safe` says whether its
forward may be captured in a CUDA graph, and `graph_buffers` gives the static buffers (and the
staging of a step into them) that such graphs read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import numpy as np
import torch

ToDevice = Callable[[np.ndarray], torch.Tensor]  # one host->device copy (the runner's: pinned, non-blocking)
ALIGN_BYTES = 16


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
    # Set by backends whose kernels read them (triton's build_metadata), in steps that are not
    # decode-only: q rows 0..num_decode_rows-1 are one-token sequences for the decode kernel, over
    # contexts decode_seq_lens (0: padding row of a CUDA graph); extend_tiles is the extend kernel's
    # tile map (int32 [2, n], kernels.extend_attention.extend_tile_map) of the rest.
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


class GraphBuffers(Protocol):
    """A backend's static metadata buffers for a set of CUDA graphs, one graph per ladder size.

    A graph of `size` is captured reading meta(size); before a replay, stage() copies a step's
    metadata into the buffers (device-side copies, no host sync) and pads what lies past the step
    so the padded rows write nothing and attend over nothing.
    """

    def meta(self, size: int) -> AttentionMetadata:
        """The metadata (views of the static buffers) a graph of `size` tokens is captured with."""
        ...

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a step's metadata can be staged into these buffers."""
        ...

    def stage(self, meta: AttentionMetadata, num_tokens: int, size: int) -> None:
        """Copy a step of num_tokens tokens into the buffers of the graph of `size` (>= num_tokens)."""
        ...


class AttentionBackend(Protocol):
    """Writes the new K/V into the paged cache and attends over each sequence's context."""

    name: str
    graph_safe: bool  # forward has no host syncs and fixed launch shapes per graph buffers: capturable
    cache_layouts: tuple[str, ...]  # KV cache layouts it reads (engine/kv_cache.KV_LAYOUTS), preferred first

    def build_metadata(
        self,
        query_lens: np.ndarray,  # int64 [B]: new tokens per sequence this step
        seq_lens: np.ndarray,  # int64 [B]: context length after this step
        block_tables: np.ndarray,  # int32 [B, W]
        slot_mapping: torch.Tensor,  # int64 [T] on the device
        to_device: ToDevice,
    ) -> AttentionMetadata:
        """The metadata of one packed step (its device arrays in one host->device copy)."""
        ...

    def graph_buffers(
        self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, decode_only: bool, device: torch.device
    ) -> GraphBuffers:
        """Static buffers for graphs of decode-only steps (size = batch size, at most max_seqs) or of
        any steps (size = padded token count, at most max_tokens, of at most max_seqs sequences).
        Only for graph_safe backends."""
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
        kv_scales: tuple[float, float] | None = None,  # (k_scale, v_scale) of an FP8 cache; None: the backend's kv_scale
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


def concat_aligned(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int]]:
    """Concatenate same-dtype arrays, each starting at a multiple of 16 bytes; returns the buffer and
    each part's start. Triton specialises kernels on 16-byte pointer alignment, so unaligned views
    into one packed buffer (their alignment changing with the step's token count) would compile a
    kernel variant in the middle of a run (measured: ~1 s each, BENCHMARKS.md)."""
    per = max(1, ALIGN_BYTES // parts[0].dtype.itemsize)
    starts, pos = [], 0
    for p in parts:
        starts.append(pos)
        pos += -(-len(p) // per) * per
    out = np.zeros(pos, dtype=parts[0].dtype)
    for p, s in zip(parts, starts):
        out[s : s + len(p)] = p
    return out, starts


def pack_metadata(
    query_lens: np.ndarray,
    seq_lens: np.ndarray,
    block_tables: np.ndarray,
    slot_mapping: torch.Tensor,
    to_device: ToDevice,
    extra: Sequence[np.ndarray] = (),
) -> tuple[AttentionMetadata, list[torch.Tensor]]:
    """The common metadata of a packed step, its int32 arrays (query starts, context lengths, block
    tables, then `extra`, each 16-byte aligned) in ONE host->device copy; returns it and the device
    views of the extra arrays (flat) for the backend's own fields."""
    nb, width = block_tables.shape
    cu = np.zeros(nb + 1, dtype=np.int64)
    np.cumsum(query_lens, out=cu[1:])
    parts = [cu.astype(np.int32), seq_lens.astype(np.int32), block_tables.ravel(), *extra]
    ints_np, at = concat_aligned(parts)
    ints = to_device(ints_np)
    lens_list = query_lens.tolist()
    seq_lens_list = seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=slot_mapping,
        query_start_loc=ints[at[0] : at[0] + nb + 1],
        seq_lens=ints[at[1] : at[1] + nb],
        block_tables=ints[at[2] : at[2] + nb * width].view(nb, width),
        max_query_len=max(lens_list),
        max_seq_len=max(seq_lens_list),
        query_lens_cpu=lens_list,
        seq_lens_cpu=seq_lens_list,
        decode_only=bool((query_lens == 1).all()),
    )
    views = [ints[at[3 + i] : at[3 + i] + len(p)] for i, p in enumerate(extra)]
    return meta, views
