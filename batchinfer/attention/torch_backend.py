"""Plain PyTorch attention over the paged KV cache: the CPU backend and the reference for GPU kernels.

For each step it (1) scatters the new tokens' K/V into the cache at meta.slot_mapping (slots < 0 are
skipped), then (2) attends, with the query rows aligned to the END of the context: query i of a
chunk of q tokens in a context of s tokens sits at position s - q + i and sees keys 0..s - q + i.
That one rule covers full prefill, chunked prefill, prefix-shared prefill and decode, mixed freely
in one batch.

Batched, not one call per sequence: a step's query rows are cut into tiles (a decode row is a tile
of 1; a prefill chunk is tiles of at most TILE_ROWS rows), tiles of similar size are grouped, and
each group is ONE scaled_dot_product_attention over padded tensors: its contexts gathered from the
cache slot by slot, its queries with the GQA group folded into the query axis (q heads h = kv * G + g
share kv head kv, so no K/V copy per q head), an additive mask for causality and padding. Padded key
positions read the sequence's own first slot (always written), so an unwritten slot is never read
and the mask alone hides the padding. The plan (index tensors and masks) is built once per step on
the host with numpy and reused by every layer. On SmolLM2-135M at 40 sequences this replaced 1,200
small attention calls per decode step by 30 (BENCHMARKS.md, CPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from batchinfer.attention.base import AttentionMetadata, GraphBuffers, ToDevice, pack_metadata
from batchinfer.kernels.reference import from_kv_cache, to_kv_cache

TILE_ROWS = 256  # query rows per prefill tile (bounds a group's score matrix)
MAX_PADDING = 2.0  # a group's padded work may be at most this times its real work ...
MIN_GROUP_WORK = 1 << 16  # ... unless the group is this small (query rows x keys)
MAX_GROUP_SCORES = 1 << 24  # query rows x keys per group (x heads: the score matrix), bounds memory


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
    kv_scale: float = 1.0, v_scale: float | None = None,
) -> None:
    """Copy k/v [T, kv_heads, head_dim] into the caches at slots [T]; slots < 0 are not written. An
    FP8 cache stores k / kv_scale and v / v_scale (v_scale None: kv_scale; kernels/reference.py to_kv_cache)."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    if k_cache.dtype == torch.float8_e4m3fn:  # copied as bytes: index_copy_ has no FP8 kernel everywhere
        for cache, x, s in ((k_cache, k, kv_scale), (v_cache, v, kv_scale if v_scale is None else v_scale)):
            flat = cache.view(torch.uint8).view(-1, *cache.shape[2:])
            flat.index_copy_(0, slots, to_kv_cache(x, cache.dtype, s).view(torch.uint8))
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence: [seq_len, kv_heads, head_dim]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = block_table[:num_blocks].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:seq_len]


@dataclass(frozen=True)
class _Group:
    """Tiles attended in one call. n tiles, each padded to q_rows query rows and keys keys."""

    n: int
    q_rows: int
    keys: int
    q_index: torch.Tensor | None  # int64 [n * q_rows]: packed row of each padded query slot; None: rows start.. in order
    start: int  # first packed row when q_index is None
    slots: torch.Tensor  # int64 [n * keys]: cache slot of each key position (padding: the sequence's slot 0)
    mask: torch.Tensor  # [n, 1, q_rows (x G when folded), keys] additive (0 / -inf)
    dst: torch.Tensor | None  # int64 [real rows]: packed rows the group's real query rows write
    src: torch.Tensor | None  # int64 [real rows]: their index in the padded [n * q_rows] output


@dataclass(frozen=True)
class _Tile:
    seq: int
    row: int  # first packed query row
    rows: int
    first_pos: int  # context position of its first query row
    keys: int  # keys it sees: first_pos + rows


def _tiles(meta: AttentionMetadata) -> list[_Tile]:
    tiles = []
    row = 0
    for b, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len > seq_len:
            raise ValueError(f"sequence {b}: query_len {q_len} exceeds seq_len {seq_len}")
        first = seq_len - q_len
        for r0 in range(0, q_len, TILE_ROWS):
            rows = min(TILE_ROWS, q_len - r0)
            tiles.append(_Tile(b, row + r0, rows, first + r0, first + r0 + rows))
        row += q_len
    return tiles


def _group_tiles(tiles: list[_Tile]) -> list[list[_Tile]]:
    """Tiles of similar shape together: sorted by (rows, keys), a group grows while its padded work
    stays within MAX_PADDING of the real work (or is small) and its score matrix within bounds."""
    groups: list[list[_Tile]] = []
    for t in sorted(tiles, key=lambda t: (t.rows, t.keys)):
        if groups:
            g = groups[-1]
            n, rows, keys = len(g) + 1, max(t.rows, max(x.rows for x in g)), max(t.keys, max(x.keys for x in g))
            padded = n * rows * keys
            real = t.rows * t.keys + sum(x.rows * x.keys for x in g)
            if padded <= MAX_GROUP_SCORES and (padded <= MAX_PADDING * real or padded <= MIN_GROUP_WORK):
                g.append(t)
                continue
        groups.append([t])
    return groups


def _build_group(tiles: list[_Tile], tables: np.ndarray, block_size: int, group: int, device, dtype) -> _Group:
    n = len(tiles)
    q_rows = max(t.rows for t in tiles)
    keys = max(t.keys for t in tiles)
    seqs = np.array([t.seq for t in tiles], dtype=np.int64)
    pos = np.arange(keys, dtype=np.int64)
    visible = np.array([t.keys for t in tiles], dtype=np.int64)
    slots = tables[seqs[:, None], np.minimum(pos[None, :], visible[:, None] - 1) // block_size] * block_size
    slots += np.minimum(pos[None, :], visible[:, None] - 1) % block_size
    slots = np.where(pos[None, :] < visible[:, None], slots, slots[:, :1])  # padding: the sequence's slot 0
    # query row i of tile t (i < rows) sees keys 0..first_pos + i; padding rows see what row 0 sees
    first = np.array([t.first_pos for t in tiles], dtype=np.int64)
    rows = np.array([t.rows for t in tiles], dtype=np.int64)
    i = np.arange(q_rows, dtype=np.int64)
    limit = first[:, None] + np.where(i[None, :] < rows[:, None], i[None, :], 0)
    allowed = pos[None, None, :] <= limit[:, :, None]  # [n, q_rows, keys]
    mask = np.where(allowed, np.float32(0.0), np.float32(-math.inf))[:, None]  # [n, 1, q_rows, keys]
    if q_rows > 1 and group > 1:  # folded GQA: query axis is (g, i)
        mask = np.broadcast_to(mask[:, :, None], (n, 1, group, q_rows, keys)).reshape(n, 1, group * q_rows, keys)
    starts = np.array([t.row for t in tiles], dtype=np.int64)
    contiguous = bool((rows == q_rows).all()) and bool((np.diff(starts) == q_rows).all())
    q_index = dst = src = None
    if not contiguous:
        q_index_np = starts[:, None] + np.minimum(i[None, :], rows[:, None] - 1)
        real = i[None, :] < rows[:, None]
        q_index = torch.from_numpy(q_index_np.reshape(-1)).to(device)
        dst = torch.from_numpy(q_index_np[real]).to(device)
        src = torch.from_numpy(np.flatnonzero(real.reshape(-1))).to(device)
    return _Group(
        n=n, q_rows=q_rows, keys=keys, q_index=q_index, start=int(starts[0]),
        slots=torch.from_numpy(slots.reshape(-1)).to(device),
        mask=torch.from_numpy(np.ascontiguousarray(mask)).to(device=device, dtype=dtype),
        dst=dst, src=src,
    )


def _select(flat: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """flat.index_select(0, slots); an FP8 cache through its bytes (index_select has no FP8 kernel everywhere)."""
    if flat.dtype == torch.float8_e4m3fn:
        return flat.view(torch.uint8).index_select(0, slots).view(flat.dtype)
    return flat.index_select(0, slots)


class TorchAttentionBackend:
    """AttentionBackend in plain PyTorch (any device; used on CPU). kv_scale: the per-tensor scale of
    an FP8 KV cache (stored x / kv_scale, read back times it) for layers that give no kv_scales of
    their own; a cache in the model's dtype ignores both."""

    name = "torch"
    graph_safe = False  # loops over sequences on the host (query_lens_cpu): nothing to capture
    cache_layouts = ("token",)  # reads and writes through a flat [slots, kv_heads, head_dim] view

    def __init__(self, kv_scale: float = 1.0) -> None:
        self.kv_scale = kv_scale
        # The plan of the step being run (all layers share one AttentionMetadata): (meta, key, groups).
        self._plan: tuple[AttentionMetadata, tuple, list[_Group]] | None = None

    def _groups(self, meta: AttentionMetadata, block_size: int, group: int, device, dtype) -> list[_Group]:
        key = (block_size, group, device, dtype)
        if self._plan is not None and self._plan[0] is meta and self._plan[1] == key:
            return self._plan[2]
        tables = meta.block_tables.cpu().numpy().astype(np.int64)
        groups = [_build_group(g, tables, block_size, group, device, dtype) for g in _group_tiles(_tiles(meta))]
        self._plan = (meta, key, groups)
        return groups
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
        kv_scales: tuple[float, float] | None = None,
    ) -> torch.Tensor:
        ks, vs = kv_scales if kv_scales is not None else (self.kv_scale, self.kv_scale)
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, ks, vs)
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[2]
        group = heads // kv_heads
        groups = self._groups(meta, k_cache.shape[1], group, q.device, q.dtype)
        k_flat = k_cache.view(-1, kv_heads, head_dim)
        v_flat = v_cache.view(-1, kv_heads, head_dim)
        s = (ks, vs)
        if len(groups) == 1 and groups[0].q_index is None and groups[0].n * groups[0].q_rows == q.shape[0]:
            return self._attend(q, k_flat, v_flat, groups[0], group, scale, s).view_as(q)
        out = torch.zeros_like(q)  # rows of zero-length queries stay 0
        for g in groups:
            if g.q_index is None:
                rows = q.narrow(0, g.start, g.n * g.q_rows)
                out.narrow(0, g.start, g.n * g.q_rows).copy_(self._attend(rows, k_flat, v_flat, g, group, scale, s))
            else:
                attended = self._attend(q.index_select(0, g.q_index), k_flat, v_flat, g, group, scale, s)
                out.index_copy_(0, g.dst, attended.index_select(0, g.src))
        return out

    @staticmethod
    def _attend(q: torch.Tensor, k_flat: torch.Tensor, v_flat: torch.Tensor, g: _Group, group: int, scale: float,
                kv_scales: tuple[float, float] = (1.0, 1.0)):
        """q: [n * q_rows, heads, head_dim] of one group -> attended, same shape (rows in tile order)."""
        n, rows, keys = g.n, g.q_rows, g.keys
        heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = heads // group
        keys_t = from_kv_cache(_select(k_flat, g.slots), q.dtype, kv_scales[0]).view(n, keys, kv_heads, head_dim).transpose(1, 2)
        values = from_kv_cache(_select(v_flat, g.slots), q.dtype, kv_scales[1]).view(n, keys, kv_heads, head_dim).transpose(1, 2)
        if rows == 1:  # decode: the G query heads of a kv head are the query axis
            query = q.view(n, kv_heads, group, head_dim)
            out = F.scaled_dot_product_attention(query, keys_t, values, attn_mask=g.mask, scale=scale)
            return out.reshape(n, heads, head_dim)
        query = q.view(n, rows, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(n, kv_heads, group * rows, head_dim)
        out = F.scaled_dot_product_attention(query, keys_t, values, attn_mask=g.mask, scale=scale)
        return out.view(n, kv_heads, group, rows, head_dim).permute(0, 3, 1, 2, 4).reshape(n * rows, heads, head_dim)
