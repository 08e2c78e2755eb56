"""Small helpers shared by the kernel launchers (block sizes, dtype checks)."""

from __future__ import annotations

import torch
import triton


def pow2(n: int, at_least: int = 1) -> int:
    """The next power of two >= max(n, at_least): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), at_least)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride; everything else goes through strides."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride()})")


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs must not silently drop to TF32 in tl.dot: greedy float32 runs are compared
    token for token against transformers."""
    return "ieee" if dtype == torch.float32 else "tf32"
