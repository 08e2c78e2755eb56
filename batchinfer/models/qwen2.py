"""Qwen2 / Qwen2.5: bias on the q/k/v projections (not on o); often tied embeddings."""

from __future__ import annotations

from dataclasses import replace

from batchinfer.models.hf_config import cap_to_sliding_window, common_config
from batchinfer.models.layers import ModelConfig

ARCHITECTURE = "Qwen2ForCausalLM"


def model_config(hf: dict) -> ModelConfig:
    cfg = common_config(hf, ARCHITECTURE, qkv_bias=True)
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return replace(cfg, max_position_embeddings=cap_to_sliding_window(cfg.max_position_embeddings, window))
