"""Applying a token bitmask to logits (the step between the grammar and the sampler).

Bitmask convention (structured/base.py): int32 [B, ceil(V/32)], bit j of word i set = token
i*32 + j allowed. Disallowed logits become -inf. On CUDA the Triton kernel in
batchinfer.kernels.bitmask is used when it can be imported; this torch version is the reference
and the CPU path (vectorised: one unpack of all words, no Python loop over the vocabulary).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowMasks:
    """A step's bitmask as its distinct rows and a row index: row i of the dense bitmask is
    table[index[i]]. Rows that share a grammar state (or a mask kept from an earlier step) share a
    table row, so the host writes, and the bus carries, one row per distinct mask instead of one per
    sampling row (engine/grammar.py fills these; the sampler gathers them on its device).

    table: int32 [U, ceil(V/32)] on the CPU (pinned on a GPU engine); index: int64 [B] on the CPU.
    """

    table: torch.Tensor
    index: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        """The dense bitmask's shape [B, ceil(V/32)]."""
        return (self.index.shape[0], self.table.shape[1])

    def dense(self) -> torch.Tensor:
        """The dense int32 bitmask [B, ceil(V/32)] on the CPU (a copy)."""
        return torch.from_numpy(self.table.numpy()[self.index.numpy()])

    def on(self, device: torch.device) -> torch.Tensor:
        """The dense bitmask on `device`: table and index copied there (non-blocking from pinned
        memory), then gathered there."""
        table = self.table.to(device, non_blocking=True)
        index = self.index.to(device, non_blocking=True)
        return table.index_select(0, index)


def allocate_token_bitmask(batch: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """An all-allowed (-1) int32 bitmask of shape [batch, ceil(vocab_size/32)] on the CPU."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size]: True where the token is allowed (ids past 32*words are disallowed).

    On the CPU numpy unpacks the bytes (bit j of little-endian word i is byte i*4 + j//8's bit
    j%8): 18x faster than the shifts, which build an int32 [B, W, 32] temporary (256 rows of the
    151k Qwen vocabulary: 21 against 377 ms on a 2-core CPU)."""
    if bitmask.device.type == "cpu" and sys.byteorder == "little":
        bits = np.unpackbits(bitmask.contiguous().numpy().view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(bits).view(torch.bool)
    else:
        shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]; arithmetic shift is fine with & 1
        allowed = bits.reshape(bitmask.shape[0], -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros(bitmask.shape[0], vocab_size - width, dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_torch_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Torch reference: set logits of disallowed tokens to -inf in place; returns logits."""
    return _disallow_(logits, unpack_bitmask(bitmask.to(logits.device), logits.shape[-1]))


def _disallow_(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits[~allowed] = -inf in place (allowed: bool, logits' shape); returns logits."""
    return logits.masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor | RowMasks) -> torch.Tensor:
    """Mask logits [B, V] in place with an int32 bitmask [B, ceil(V/32)] (a tensor on any device,
    or RowMasks); returns logits.

    Dispatches to batchinfer.kernels.bitmask.apply_token_bitmask_triton on CUDA when available. On
    the CPU, RowMasks are unpacked once per distinct mask, then gathered.
    """
    if isinstance(bitmask, RowMasks):
        if logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[0] == bitmask.shape[0]:
            return _disallow_(logits, unpack_bitmask(bitmask.table, logits.shape[-1]).index_select(0, bitmask.index))
        bitmask = bitmask.on(logits.device)
    if logits.dim() != 2 or bitmask.dim() != 2 or logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f"logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must be [B, V] and [B, W]")
    if bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be int32, not {bitmask.dtype}")
    if logits.is_cuda:
        try:
            from batchinfer.kernels.bitmask import apply_token_bitmask_triton
        except ImportError:
            apply_token_bitmask_triton = None
        if apply_token_bitmask_triton is not None:
            apply_token_bitmask_triton(logits, bitmask.to(logits.device, non_blocking=True))
            return logits
    return apply_token_bitmask_torch_(logits, bitmask)

