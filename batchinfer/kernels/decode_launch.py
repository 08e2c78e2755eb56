"""The launch configuration of paged decode attention, derived from the shape (no lookup table).

A pure function of (batch, query heads, KV heads, head_dim, KV element bytes, SM count): never of
the sequence lengths, so a CUDA graph captured at one batch size replays the right launch.

Two work splits (kernels/decode_attention.py):
- "sequence": grid (batch, KV heads, splits); each sequence's context cut into `splits` equal
  slices; a merge kernel combines the slices (one split: no merge).
- "balanced": grid (programs, KV heads); the batch's contexts laid end to end and cut into
  `programs` equal token ranges, so every program streams the same number of KV bytes whatever
  the lengths; a sequence inside one range is written directly, only the ones cut by a range
  boundary are merged (kernels/decode_balanced.py).

The rule, fitted on an H200 sweep (scripts/decode_shape_sweep.py over eleven released shapes at
batch 256/64/8, contexts uniform in [100, 2048]; BENCHMARKS.md has the table):
- block_n: K/V tiles of 8192 elements (16 KB in 16 bits): 128 keys for head_dim 64, 64 for 128.
  The widened tile lives in registers, so elements (not the cache's bytes) set it; FP8 caches
  get the same tile until measured (KV_TILES below).
- splits: the smallest power of two >= 2, at most 16, with batch x query heads x splits >= 32 x
  SMs partial rows (a row: one query head's output over one slice, written by the split kernel and
  read by the merge). Counting KV-head programs instead (>= 4 x SMs) fits the sweep a little
  worse (97.6% of the best config's bandwidth on average at batch >= 64 against 98.1%): the
  shapes with 8 KV heads at batch 64 want 8 slices, the 2-KV-head ones at batch 256 want 2, at the
  same program count. Never one split: the merge-free single pass lost up to 8 points with 2 KV
  heads at batch 256 and won at most 2 elsewhere.
- 4 warps, 2 stages: no 8-warp or 3-stage config won by more than a point or two.
"""

from __future__ import annotations

from dataclasses import dataclass

ROWS_PER_SM = 32  # "sequence" split: partial rows (sequence x query head x slice) per SM
MAX_SPLITS = 16
TILE_ELEMENTS = 8192  # block_n x head_dim of one K (or V) tile

# KV element bytes -> (tile elements, num_warps, num_stages) of the "sequence" split's kernel.
# 2 bytes (bf16/fp16; a 4-byte float32 cache takes these too): measured, the rule above.
# 1 byte (FP8 e4m3): twice the elements per tile (the same bytes per iteration as a 2-byte tile).
#   `python3 scripts/decode_shape_sweep.py --kv fp8` on the H200 (qwen3-0.6b and llama-3.1-8b, batch
#   256/64/8, each at the rule's split count): (16384, 4, 2) 1.117x the time of (8192, 4, 2) in
#   geometric mean; block_n 128 won every shape and batch (BENCHMARKS.md, seventh session).
KV_TILES: dict[int, tuple[int, int, int]] = {
    2: (TILE_ELEMENTS, 4, 2),
    1: (2 * TILE_ELEMENTS, 4, 2),
}


@dataclass(frozen=True)
class DecodeLaunch:
    splits: int  # "sequence": slices per (sequence, KV head); "balanced": token ranges per KV head
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    work: str = "sequence"  # "sequence" | "balanced"


def decode_block_n(head_dim: int, tile_elements: int = TILE_ELEMENTS) -> int:
    """Keys per inner iteration: tile_elements / head_dim, a power of two in [16, 128] (up to 256
    for a tile of more than 128 x head_dim elements)."""
    n, top = 16, (256 if tile_elements > 128 * head_dim else 128)
    while n < top and n * 2 * head_dim <= tile_elements:
        n *= 2
    return n


def launch_config(
    batch: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_bytes: int,
    sms: int | None,
    work: str = "sequence",
    programs_per_sm: float | None = None,
    rows_per_sm: float = ROWS_PER_SM,
) -> DecodeLaunch:
    """The decode attention launch for a batch of `batch` sequences of this model shape on a GPU
    with `sms` SMs (None: the CPU interpreter, 8 slices, any grid works).

    work "sequence": rows_per_sm sets the slices (the rule above). work "balanced":
    `programs_per_sm` x SMs programs in all (default 3, unmeasured: about the resident CTAs of a
    16 KB-tile program), split over the KV heads; the split count is then the token ranges per KV
    head, independent of the batch. kv_bytes picks the tile, warps and stages (KV_TILES).
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if work not in ("sequence", "balanced"):
        raise ValueError(f"decode work split must be 'sequence' or 'balanced', not {work!r}")
    tile, warps, stages = KV_TILES[1 if kv_bytes == 1 else 2]  # by KV element size: see KV_TILES
    block_n = decode_block_n(head_dim, tile)
    if work == "balanced":
        per_sm = 3.0 if programs_per_sm is None else programs_per_sm
        total = 8 if sms is None else max(1, round(per_sm * sms))
        return DecodeLaunch(splits=max(1, -(-total // num_kv_heads)), block_n=block_n, num_warps=warps,
                            num_stages=stages, work="balanced")
    if sms is None:
        return DecodeLaunch(splits=8, block_n=block_n, num_warps=warps, num_stages=stages)
    splits = 2
    while splits < MAX_SPLITS and batch * num_heads * splits < rows_per_sm * sms:
        splits *= 2
    return DecodeLaunch(splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
