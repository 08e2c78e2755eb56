"""Rotary position embedding: reading the config's rope settings and the precomputed cos/sin cache.

Checkpoints spell rope settings two ways: older configs have `rope_theta` and an optional
`rope_scaling` dict (with "type" or "rope_type"); transformers 5 writes one `rope_parameters` dict
holding `rope_theta` and `rope_type`. Both are read into one frozen `RopeConfig`.
Supported types: default, linear, llama3, yarn (others are refused with a clear message, since a
silently wrong rope gives plausible-looking but wrong text).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """theta: the rope base; rope_type: one of SUPPORTED_ROPE_TYPES; params: the scaling keys, sorted."""

    theta: float
    rope_type: str = "default"
    params: tuple[tuple[str, object], ...] = ()

    def get(self, key: str, default=None):
        return dict(self.params).get(key, default)


def rope_config_from_hf(hf: dict) -> RopeConfig:
    """Read rope settings from a config.json dict (either spelling). Raises ValueError on unsupported types."""
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"config.json: rope settings must be an object, not {scaling!r}")
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json: partial_rotary_factor other than 1.0 is not supported")
    params = tuple(sorted((k, v) for k, v in scaling.items() if k not in ("rope_theta", "rope_type", "type")))
    if rope_type in ("linear", "llama3", "yarn") and "factor" not in dict(params):
        raise ValueError(f"config.json: rope type {rope_type!r} needs a 'factor'")
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=params)


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """The per-pair inverse frequencies (float32, [head_dim // 2]) and the cos/sin scale factor."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq, 1.0
    factor = float(rope.get("factor"))
    if rope.rope_type == "linear":
        return inv_freq / factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope, factor), 1.0
    return _yarn(rope, head_dim, factor, max_position_embeddings)


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig, factor: float) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by factor, short kept, the middle band interpolated."""
    low = float(rope.get("low_freq_factor", 1.0))
    high = float(rope.get("high_freq_factor", 4.0))
    old_len = float(rope.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, head_dim: int, factor: float, max_pos: int) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated and extrapolated frequencies over a ramp; scale cos/sin by mscale."""
    base = rope.theta
    original = float(rope.get("original_max_position_embeddings") or max_pos)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = rope.get("beta_fast") or 32
    beta_slow = rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding over a cos/sin cache built once for every position.

    cos_sin_cache: float32 [max_positions, head_dim] = [cos | sin] of each pair's angle. Applying it is
    one gather and a few elementwise ops on the whole packed batch (no per-token Python).
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq, scale = inverse_frequencies(rope, head_dim, max_positions)
        positions = torch.arange(max_positions, dtype=torch.float32)
        angles = positions[:, None] * inv_freq[None, :]
        cache = torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)
        self.head_dim = head_dim
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, heads, head_dim], k: [T, kv_heads, head_dim]; returns both rotated, in their dtype."""
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        cos = cos.to(q.dtype).unsqueeze(1)
        sin = sin.to(q.dtype).unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
