"""Attention backends by name: `get_attention_backend(name, device, gqa_group, kv_scale)`.

BACKENDS maps a name to a factory that imports its module only when called, so a GPU backend's
dependencies (triton) are never imported on a machine that does not use them.
"auto" picks torch on CPU and the first backend of AUTO_GPU_ORDER that can be built on a GPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from batchinfer.attention.base import AttentionBackend, AttentionMetadata, GraphBuffers


def _torch_backend(device: torch.device, gqa_group: int, kv_scale: float = 1.0) -> AttentionBackend:
    from batchinfer.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_scale=kv_scale)


def _triton_backend(device: torch.device, gqa_group: int, kv_scale: float = 1.0) -> AttentionBackend:
    from batchinfer.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(gqa_group=gqa_group, kv_scale=kv_scale)


def _triton_balanced_backend(device: torch.device, gqa_group: int, kv_scale: float = 1.0) -> AttentionBackend:
    """The Triton backend with decode attention's "balanced" work split (kernels/decode_launch.py):
    to measure it against "triton" end to end (`bench throughput --attention-backend triton-balanced`)."""
    from batchinfer.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(gqa_group=gqa_group, kv_scale=kv_scale, decode_work="balanced")


BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
    "triton-balanced": _triton_balanced_backend,
}

# A flash-attn backend is not written yet (flash-attn 2's paged KV wants 256-token pages); it would
# go first here, and auto skips any backend whose import fails.
AUTO_GPU_ORDER = ("triton", "torch")


def get_attention_backend(name: str, device: torch.device | str, gqa_group: int = 1, kv_scale: float = 1.0) -> AttentionBackend:
    """Build the backend `name` (or "auto") for `device` and a model with `gqa_group` query heads per
    KV head; kv_scale: the per-tensor scale of an FP8 KV cache (engine.kv_cache_scale). Unknown names
    raise ValueError listing the known ones."""
    device = torch.device(device)
    if name == "auto":
        if device.type == "cpu":
            return BACKENDS["torch"](device, gqa_group, kv_scale)
        for candidate in AUTO_GPU_ORDER:
            if candidate in BACKENDS:
                try:
                    return BACKENDS[candidate](device, gqa_group, kv_scale)
                except ImportError:
                    continue
        raise RuntimeError(f"no attention backend could be built for {device}")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(sorted(BACKENDS))}")
    return BACKENDS[name](device, gqa_group, kv_scale)


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "GraphBuffers", "get_attention_backend"]
