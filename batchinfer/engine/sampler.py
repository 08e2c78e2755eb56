"""Batched sampling on the device: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Every row is sampled with the Gumbel-max trick, argmax(filtered_logits / T + G), where the
Gumbel noise G of token j in row i is a pure function of (seed_i, step_i, j): a keyed integer
hash (counter-based RNG), not a torch.Generator. A request therefore draws the same tokens
whatever else shares the batch and at whatever row index it sits.

The hash works on int64 tensors holding 32-bit values; every multiplier is below 2**31, so
no product overflows int64 and the arithmetic is identical on CPU and CUDA.

Filtering keeps, per row, every token whose scaled logit is at least a threshold:
  top-k: the k-th largest logit (ties at the k-th value are kept);
  top-p: applied after top-k, the smallest logit of the shortest prefix (sorted by
         probability) whose mass reaches p;
  min-p: max logit + log(min_p), i.e. p_i >= min_p * p_max.
When every sampled row has a top-k, filtering and noise run on the top max(k) candidates
only (the noise is keyed by token id, so the draw is the same as on the full vocabulary,
except for exact logit ties at the k-th value beyond the candidates).

On CUDA, a batch with no top-k / top-p / min-p row (the common offline case) is drawn by one
fused Triton kernel (kernels/sampling.py): the same noise, temperature and argmax, computed on the
fly in a single read of the logits instead of ~25 passes of int64 temporaries over [B, V].
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchinfer.engine.request import SamplingParams

GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows float32)
_MASK32 = 0xFFFFFFFF
NOISE_CHUNK_ELEMENTS = 1 << 24  # rows * vocab hashed at once (int64 temporaries of 128 MiB)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as device tensors, plus Python flags for the fast paths.

    temperature: float32 [B] (greedy rows hold 1.0 so dividing is safe); top_k: int64 [B]
    (0 = off); top_p: float32 [B] (1.0 = off); min_p: float32 [B] (0.0 = off); seeds: int64 [B]
    (the request seed folded to 32 bits); steps: int64 [B] (tokens generated so far);
    greedy: bool [B]. The flags are computed from the Python parameters, so sample() never
    reads a device value back.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seeds: torch.Tensor
    steps: torch.Tensor
    greedy: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    all_top_k: bool  # every non-greedy row has top_k > 0 (sample on max_top_k candidates)
    max_top_k: int

    @property
    def size(self) -> int:
        return int(self.temperature.shape[0])


def _fold_seed(seed: int) -> int:
    """Fold an arbitrary Python int seed (negative or beyond 64 bits) into 32 bits."""
    value = seed & ((1 << 64) - 1)
    lo, hi = value & _MASK32, value >> 32
    return (lo ^ ((hi * 0x2545F491) & _MASK32) ^ (hi >> 3)) & _MASK32


def make_sampling_batch(
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    steps: Sequence[int],
    device: torch.device | str,
) -> SamplingBatch:
    """Gather the rows' SamplingParams, resolved seeds and step counters into device tensors."""
    if not (len(params) == len(seeds) == len(steps)):
        raise ValueError(
            f"params, seeds and steps must have one entry per row; got {len(params)}, {len(seeds)}, {len(steps)}"
        )
    greedy = [p.temperature < GREEDY_EPS for p in params]
    temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
    top_k = [0 if g else int(p.top_k) for p, g in zip(params, greedy)]
    top_p = [1.0 if g else float(p.top_p) for p, g in zip(params, greedy)]
    min_p = [0.0 if g else float(p.min_p) for p, g in zip(params, greedy)]
    sampled = [i for i, g in enumerate(greedy) if not g]
    for i, s in enumerate(steps):
        if s < 0:
            raise ValueError(f"steps[{i}] must be >= 0, got {s}")
    # One host->device copy per dtype: stack on the host, then move.
    floats = torch.tensor([temps, top_p, min_p], dtype=torch.float32).to(device, non_blocking=True)
    ints = torch.tensor(
        [top_k, [_fold_seed(int(s)) for s in seeds], [int(s) & _MASK32 for s in steps]], dtype=torch.int64
    ).to(device, non_blocking=True)
    return SamplingBatch(
        temperature=floats[0],
        top_p=floats[1],
        min_p=floats[2],
        top_k=ints[0],
        seeds=ints[1],
        steps=ints[2],
        greedy=torch.tensor(greedy, dtype=torch.bool).to(device, non_blocking=True),
        all_greedy=not sampled,
        any_greedy=any(greedy),
        any_top_k=any(top_k[i] > 0 for i in sampled),
        any_top_p=any(top_p[i] < 1.0 for i in sampled),
        any_min_p=any(min_p[i] > 0.0 for i in sampled),
        all_top_k=bool(sampled) and all(top_k[i] > 0 for i in sampled),
        max_top_k=max((top_k[i] for i in sampled), default=0),
    )


# ---------------------------------------------------------------------------------------------
# Counter-based RNG


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (hash-prospector constants 0x21f0aaad, 0x735a2d97) on int64 values.

    Input and output hold values in [0, 2**32); both multipliers are < 2**31, so x * c < 2**63.
    """
    x = x ^ (x >> 16)  # a new tensor: the input is never modified
    x.mul_(0x21F0AAAD).bitwise_and_(_MASK32)
    x ^= x >> 15
    x.mul_(0x735A2D97).bitwise_and_(_MASK32)
    x ^= x >> 15
    return x


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two 32-bit keys per row from (seed, step): [B] int64 each."""
    k1 = _mix32(_mix32(seeds) ^ steps)
    k2 = _mix32((k1 + 0x68E31DA4) & _MASK32)
    return k1, k2


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) float32 noise for every (row, token id): [B, N] from token_ids [N] or [B, N].

    Values are (h + 0.5) / 2**23 for a 23-bit hash h, exact in float32 and never 0 or 1.
    """
    k1, k2 = row_keys(seeds, steps)
    x = _mix32(token_ids ^ k1[:, None])
    x = _mix32(x.add_(k2[:, None]).bitwise_and_(_MASK32))
    return (x >> 9).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


def gumbel_noise(seeds: torch.Tensor, steps: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(U)) for every (row, token id)."""
    u = uniform_noise(seeds, steps, token_ids)
    return u.log_().neg_().log_().neg_()


# ---------------------------------------------------------------------------------------------
# Filtering (all on values sorted in descending order, per row)


def _kth_value(sorted_desc: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Per row, the k-th largest value (k >= 1); -inf where k == 0 (off). Returns [B, 1]."""
    idx = (k.clamp(min=1, max=sorted_desc.shape[1]) - 1)[:, None]
    kth = sorted_desc.gather(1, idx)
    return kth.masked_fill_((k == 0)[:, None], -math.inf)


def _top_p_threshold(sorted_desc: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest value kept by top-p over `sorted_desc` (already top-k masked). [B, 1]."""
    probs = sorted_desc.softmax(dim=-1)
    exclusive = probs.cumsum(dim=-1).sub_(probs)
    p = torch.where(top_p >= 1.0, torch.full_like(top_p, 2.0), top_p)  # off: keep everything
    num_keep = (exclusive < p[:, None]).sum(dim=-1, keepdim=True).clamp_(min=1)
    return sorted_desc.gather(1, num_keep - 1)


def _thresholds(sorted_desc: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Combined keep-threshold [B, 1] from top-k, top-p (after top-k) and min-p."""
    thr = torch.full((sorted_desc.shape[0], 1), -math.inf, device=sorted_desc.device)
    if batch.any_top_k:
        thr = _kth_value(sorted_desc, batch.top_k)
    if batch.any_top_p:
        masked = sorted_desc.masked_fill(sorted_desc < thr, -math.inf) if batch.any_top_k else sorted_desc
        thr = torch.maximum(thr, _top_p_threshold(masked, batch.top_p))
    if batch.any_min_p:
        min_thr = sorted_desc[:, :1] + batch.min_p.log()[:, None]  # log 0 = -inf: off
        thr = torch.maximum(thr, min_thr)
    return thr


def _scaled(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return logits / batch.temperature[:, None]


def _sample_candidates(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Every sampled row has top-k: filter and draw on the top max(k) candidates only."""
    k = min(batch.max_top_k, logits.shape[1])
    values, ids = torch.topk(_scaled(logits, batch), k, dim=-1, largest=True, sorted=True)
    thr = _thresholds(values, batch)
    values = values.masked_fill_(values < thr, -math.inf)
    values += gumbel_noise(batch.seeds, batch.steps, ids)
    pick = values.argmax(dim=-1, keepdim=True)
    return ids.gather(1, pick).squeeze(1)


def _sample_full(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Filter on the whole vocabulary (one sort only if some row has top-p) and draw."""
    scaled = _scaled(logits, batch)
    if batch.any_top_p:
        thr = _thresholds(scaled.sort(dim=-1, descending=True).values, batch)
    elif batch.any_top_k or batch.any_min_p:
        k = min(max(batch.max_top_k, 1), logits.shape[1])
        thr = _thresholds(torch.topk(scaled, k, dim=-1, sorted=True).values, batch)
    else:
        thr = None
    if thr is not None:
        scaled.masked_fill_(scaled < thr, -math.inf)
    token_ids = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)
    rows = max(1, NOISE_CHUNK_ELEMENTS // logits.shape[1])  # bounds the int64 temporaries
    for start in range(0, scaled.shape[0], rows):
        end = start + rows
        scaled[start:end] += gumbel_noise(batch.seeds[start:end], batch.steps[start:end], token_ids)
    return scaled.argmax(dim=-1)


def uses_fused_kernel(logits: torch.Tensor, batch: SamplingBatch) -> bool:
    """Whether sample() draws with the fused Triton kernel: logits on CUDA, some row sampled,
    and no row filtered (top-k / top-p / min-p need the whole row before the draw)."""
    return (
        logits.is_cuda
        and not batch.all_greedy
        and not (batch.any_top_k or batch.any_top_p or batch.any_min_p)
    )


def _sample_fused(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    # Imported here: triton is a Linux-only dependency and CPU-only installs never need it.
    from batchinfer.kernels.sampling import fused_sample

    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return fused_sample(logits, batch.temperature, batch.seeds, batch.steps, batch.greedy)


def sample(logits: torch.Tensor, batch: SamplingBatch, *, fused: bool = True) -> torch.Tensor:
    """Draw one token per row from logits [B, V] (any float dtype; the draw is made in float32 on
    the exact float32 value of each logit); returns int64 [B] on the logits' device.

    Greedy rows (temperature 0) take argmax of the raw logits (ties: lowest id). `fused=False`
    forces the torch path even where the fused kernel applies (both give the same tokens).
    """
    if logits.dim() != 2 or logits.shape[0] != batch.size:
        raise ValueError(f"logits must be [batch={batch.size}, vocab], got {tuple(logits.shape)}")
    if batch.all_greedy:
        return logits.argmax(dim=-1)  # widening to float32 changes no value, so no order
    if fused and uses_fused_kernel(logits, batch):
        return _sample_fused(logits, batch)
    if logits.dtype != torch.float32:
        logits = logits.float()
    if batch.all_top_k:
        sampled = _sample_candidates(logits, batch)
    else:
        sampled = _sample_full(logits, batch)
    if batch.any_greedy:
        sampled = torch.where(batch.greedy, logits.argmax(dim=-1), sampled)
    return sampled


def ban_tokens_(logits: torch.Tensor, rows: list[int], token_ids: list[list[int]]) -> None:
    """Set logits[rows[i], token_ids[i][j]] = -inf in place, in one indexed write."""
    if len(rows) != len(token_ids):
        raise ValueError(f"rows and token_ids must have the same length, got {len(rows)} and {len(token_ids)}")
    flat_rows = [r for r, ids in zip(rows, token_ids) for _ in ids]
    if not flat_rows:
        return
    flat_cols = [t for ids in token_ids for t in ids]
    index = torch.tensor([flat_rows, flat_cols], dtype=torch.int64)
    if logits.is_cuda:  # pinned, so the copy does not wait for the device
        index = index.pin_memory()
    index = index.to(logits.device, non_blocking=True)
    logits[index[0], index[1]] = -math.inf  # a Python scalar: no device tensor made from the host
