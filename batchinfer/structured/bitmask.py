"""Applying a token bitmask to logits (the step between the grammar and the sampler).

Bitmask convention (structured/base.py): int32 [B, ceil(V/32)], bit j of word i set = token
i*32 + j allowed. Disallowed logits become -inf. On CUDA the Triton kernel in
batchinfer.kernels.bitmask is used when it can be imported; this torch version is the reference
and the CPU path (vectorised: one unpack of all words, no Python loop over the vocabulary).
"""

from __future__ import annotations

import torch


def allocate_token_bitmask(batch: int, vocab_size: int, pin_memory: bool = False) -> torch.Tensor:
    """An all-allowed (-1) int32 bitmask of shape [batch, ceil(vocab_size/32)] on the CPU."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32, pin_memory=pin_memory)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [B, vocab_size]: True where the token is allowed (ids past 32*words are disallowed)."""
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
    allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[-1])
    logits.masked_fill_(~allowed, float("-inf"))
    return logits


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Mask logits [B, V] in place with an int32 bitmask [B, ceil(V/32)]; returns logits.

    Dispatches to batchinfer.kernels.bitmask.apply_token_bitmask_triton on CUDA when available.
    """
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
