"""Qwen3 (dense): RMSNorm over each head of q and k before rotary; head_dim given explicitly; no bias by default."""

from __future__ import annotations

from dataclasses import replace

from batchinfer.models.hf_config import cap_to_sliding_window, common_config
from batchinfer.models.layers import ModelConfig

ARCHITECTURE = "Qwen3ForCausalLM"


def model_config(hf: dict) -> ModelConfig:
    bias = bool(hf.get("attention_bias", False))
    cfg = common_config(hf, ARCHITECTURE, qkv_bias=bias, o_bias=bias, qk_norm=True)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return replace(cfg, max_position_embeddings=cap_to_sliding_window(cfg.max_position_embeddings, window))
