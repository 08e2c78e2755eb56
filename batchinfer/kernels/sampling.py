"""Fused sampling: counter-based Gumbel noise + temperature + argmax in one pass over the logits.

The math is engine/sampler.py's unfiltered path, token for token:

    greedy row:   argmax(logits)
    sampled row:  argmax(logits / T + G),  G = -log(-log(U)),  U = uniform_noise(seed, step, token id)

where the noise is the same keyed 32-bit integer hash as sampler.py. The torch path computes it
on int64 tensors holding 32-bit values and masks after every multiply; here it runs on uint32,
whose wrap-around arithmetic gives the same bits without int64 emulation. Ties go to the lowest
token id and NaN beats every number (torch.argmax's rules), so -inf logits (banned tokens, a
grammar bitmask) and all -inf rows come out exactly as in torch.

Grid (rows, splits). Each program walks its slice of the vocabulary in tiles, keeping a per-lane
running (value, id) winner, and reduces the lanes once at the end. With one split the winner id is
the result; with several (few rows: more programs keep the GPU busy) a second tiny kernel reduces
the per-split winners. The split count is a run-time argument, not a constexpr: it changes with the
row count, and as a constexpr every new batch size compiled a new kernel (~1 s each, mid-run).
Every per-row input (seed, step, temperature, greedy flag) is read from a
device tensor, so a launch never reads a value back to the host and can be captured in a CUDA graph.

On CUDA the logarithms call libdevice's logf, the same function torch's CUDA log uses, so the
noise is bit-identical to the torch path on the same device. The Triton interpreter (CPU tests)
has no libdevice and uses numpy's log instead (LIBDEVICE_LOG=False).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from batchinfer.kernels._util import check_last_dim_contiguous, pow2

DEFAULT_BLOCK = 2048  # vocab tile per loop iteration (elements)
TARGET_PROGRAMS = 512  # split the vocabulary until rows * splits reaches about this many programs
MIN_TILES_PER_SPLIT = 4  # never split a row into slices shorter than this many tiles
# Contract mul+add into fma inside the inlined libdevice logf, as nvcc does (--fmad=true) when it
# compiles torch's CUDA log: pinned so Triton's changing default cannot change the noise's bits.
FP_FUSION = True


@triton.jit
def _mix32(x):
    """sampler._mix32 on uint32: x * c mod 2**32 is the torch path's (x * c) & 0xFFFFFFFF."""
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    x = x ^ (x >> 15)
    return x


@triton.jit
def _row_keys(seed, step):
    """sampler.row_keys for one row: seed, step are uint32 scalars."""
    k1 = _mix32(_mix32(seed) ^ step)
    k2 = _mix32(k1 + 0x68E31DA4)
    return k1, k2


@triton.jit
def _hash_bits(k1, k2, ids):
    """The 32-bit hash of token ids (uint32) under the row keys; the uniform uses its top 23 bits."""
    return _mix32(_mix32(ids ^ k1) + k2)


@triton.jit
def _uniform(k1, k2, ids):
    """sampler.uniform_noise: (h + 0.5) / 2**23 for the 23-bit hash h, exact in float32."""
    h = (_hash_bits(k1, k2, ids) >> 9).to(tl.float32)
    return (h + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _log(x, LIBDEVICE_LOG: tl.constexpr):
    if LIBDEVICE_LOG:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _gumbel(k1, k2, ids, LIBDEVICE_LOG: tl.constexpr):
    """sampler.gumbel_noise: -log(-log(U))."""
    u = _uniform(k1, k2, ids)
    return -_log(-_log(u, LIBDEVICE_LOG), LIBDEVICE_LOG)


@triton.jit
def _better(a_val, a_idx, b_val, b_idx):
    """True where (a_val, a_idx) wins torch.argmax's order: NaN first, then larger, then lower id."""
    a_nan = a_val != a_val
    b_nan = b_val != b_val
    lower = a_idx < b_idx
    return (a_nan & (~b_nan | lower)) | (~a_nan & ~b_nan & ((a_val > b_val) | ((a_val == b_val) & lower)))


@triton.jit
def _pick(a_val, a_idx, b_val, b_idx):
    """The winner of two (value, id) candidates; a combine function for tl.reduce."""
    a_wins = _better(a_val, a_idx, b_val, b_idx)
    return tl.where(a_wins, a_val, b_val), tl.where(a_wins, a_idx, b_idx)


@triton.jit
def _perturbed(logits_ptr, offs, V, greedy, temp, k1, k2, LIBDEVICE_LOG: tl.constexpr):
    """One tile of the values whose argmax is the draw (out-of-vocab lanes hold -inf)."""
    x = tl.load(logits_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if not greedy:
        x = tl.math.div_rn(x, temp) + _gumbel(k1, k2, offs.to(tl.uint32), LIBDEVICE_LOG)
    return x


@triton.jit(do_not_specialize=["SPLIT_LEN", "NUM_SPLITS"])  # they change with the row count
def _sample_split_kernel(
    logits_ptr, temp_ptr, seed_ptr, step_ptr, greedy_ptr, val_out_ptr, idx_out_ptr,
    s_l, V, SPLIT_LEN, NUM_SPLITS,
    BLOCK: tl.constexpr, LIBDEVICE_LOG: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    greedy = tl.load(greedy_ptr + row) != 0
    temp = tl.load(temp_ptr + row)
    k1, k2 = _row_keys(tl.load(seed_ptr + row).to(tl.uint32), tl.load(step_ptr + row).to(tl.uint32))
    row_ptr = logits_ptr + row * s_l
    start = split * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, V)
    lanes = tl.arange(0, BLOCK)
    # The first tile seeds the per-lane winners, so a row of -inf still names a real id.
    best_idx = start + lanes
    best_val = _perturbed(row_ptr, best_idx, end, greedy, temp, k1, k2, LIBDEVICE_LOG)
    best_idx = tl.where(best_idx < end, best_idx, 0x7FFFFFFF)
    for tile_start in range(start + BLOCK, end, BLOCK):
        offs = tile_start + lanes
        val = _perturbed(row_ptr, offs, end, greedy, temp, k1, k2, LIBDEVICE_LOG)
        # Later tiles hold higher ids: a lane takes a value only if it is strictly better.
        take = _better(val, offs, best_val, best_idx) & (offs < end)
        best_val = tl.where(take, val, best_val)
        best_idx = tl.where(take, offs, best_idx)
    win_val, win_idx = tl.reduce((best_val, best_idx), 0, _pick)
    tl.store(val_out_ptr + row * NUM_SPLITS + split, win_val)
    tl.store(idx_out_ptr + row * NUM_SPLITS + split, win_idx.to(tl.int64))


@triton.jit
def _reduce_splits_kernel(val_ptr, idx_ptr, out_ptr, NUM_SPLITS, BLOCK_S: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_S)
    mask = offs < NUM_SPLITS
    val = tl.load(val_ptr + row * NUM_SPLITS + offs, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * NUM_SPLITS + offs, mask=mask, other=0x7FFFFFFF)
    _, win_idx = tl.reduce((val, idx), 0, _pick)
    tl.store(out_ptr + row, win_idx)


@triton.jit
def _noise_kernel(seed_ptr, step_ptr, ids_ptr, u_ptr, g_ptr, N, BLOCK: tl.constexpr, LIBDEVICE_LOG: tl.constexpr):
    """Test hook: the kernel's own uniform and Gumbel noise for (row, token id), [B, N]."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    k1, k2 = _row_keys(tl.load(seed_ptr + row).to(tl.uint32), tl.load(step_ptr + row).to(tl.uint32))
    ids = tl.load(ids_ptr + offs, mask=mask, other=0).to(tl.uint32)
    tl.store(u_ptr + row * N + offs, _uniform(k1, k2, ids), mask=mask)
    tl.store(g_ptr + row * N + offs, _gumbel(k1, k2, ids, LIBDEVICE_LOG), mask=mask)


def _libdevice_log(device: torch.device) -> bool:
    """libdevice only exists when the kernel is compiled for CUDA (not under the interpreter)."""
    return device.type == "cuda"


def num_splits(rows: int, vocab: int, block: int) -> int:
    """How many vocabulary slices per row: enough programs to fill the GPU when rows are few,
    never slices shorter than MIN_TILES_PER_SPLIT tiles. Depends on shapes only (graph-safe)."""
    want = triton.cdiv(TARGET_PROGRAMS, max(rows, 1))
    most = max(1, vocab // (block * MIN_TILES_PER_SPLIT))
    return max(1, min(want, most))


def fused_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    steps: torch.Tensor,
    greedy: torch.Tensor,
    block: int = DEFAULT_BLOCK,
    splits: int | None = None,
) -> torch.Tensor:
    """One token per row of logits [B, V] (float32, or bf16/fp16 read as their exact float32
    values): argmax(logits) where greedy, else
    argmax(logits / temperature + Gumbel(seed, step, id)). Returns int64 [B] on the logits' device.

    temperature float32 [B] (1.0 on greedy rows), seeds / steps int64 [B] holding 32-bit values,
    greedy bool [B]: SamplingBatch's tensors. `splits` overrides the vocabulary split count.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    rows, vocab = logits.shape
    for name, t, dtype in (
        ("temperature", temperature, torch.float32), ("seeds", seeds, torch.int64),
        ("steps", steps, torch.int64), ("greedy", greedy, torch.bool),
    ):
        if t.shape != (rows,) or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} of shape ({rows},), got {t.dtype} {tuple(t.shape)}")
    if vocab >= 2**31 - 1:
        raise ValueError(f"vocab {vocab} does not fit the kernel's int32 token ids")
    check_last_dim_contiguous("logits", logits)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if vocab == 0:
        raise ValueError("logits have an empty vocabulary dimension")
    block = min(pow2(block, 16), pow2(vocab, 16))
    n_splits = splits if splits is not None else num_splits(rows, vocab, block)
    split_len = triton.cdiv(triton.cdiv(vocab, n_splits), block) * block
    n_splits = triton.cdiv(vocab, split_len)  # no empty slice
    vals = torch.empty(rows, n_splits, dtype=torch.float32, device=logits.device)
    idx = out.view(rows, 1) if n_splits == 1 else torch.empty(rows, n_splits, dtype=torch.int64, device=logits.device)
    _sample_split_kernel[(rows, n_splits)](
        logits, temperature, seeds, steps, greedy, vals, idx,
        logits.stride(0), vocab, split_len, n_splits,
        BLOCK=block, LIBDEVICE_LOG=_libdevice_log(logits.device),
        num_warps=8 if block >= 2048 else 4, enable_fp_fusion=FP_FUSION,
    )
    if n_splits > 1:
        _reduce_splits_kernel[(rows,)](vals, idx, out, n_splits, BLOCK_S=pow2(n_splits, 32), num_warps=1)
    return out


def kernel_noise(
    seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor, block: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """(uniform, gumbel) float32 [B, N] as the sampling kernel computes them, for token_ids [N]:
    lets tests compare the kernel's noise with sampler.uniform_noise / gumbel_noise directly."""
    rows, n = seeds.shape[0], token_ids.shape[0]
    u = torch.empty(rows, n, dtype=torch.float32, device=seeds.device)
    g = torch.empty_like(u)
    if rows and n:
        block = min(pow2(block, 16), pow2(n, 16))
        _noise_kernel[(rows, triton.cdiv(n, block))](
            seeds.contiguous(), steps.contiguous(), token_ids.contiguous(), u, g, n,
            BLOCK=block, LIBDEVICE_LOG=_libdevice_log(seeds.device), enable_fp_fusion=FP_FUSION,
        )
    return u, g
