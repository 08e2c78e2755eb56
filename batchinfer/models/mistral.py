"""Mistral: Llama's layout without biases; a sliding_window (v0.1) caps the usable context at the window."""

from __future__ import annotations

from dataclasses import replace

from batchinfer.models.hf_config import cap_to_sliding_window, common_config
from batchinfer.models.layers import ModelConfig

ARCHITECTURE = "MistralForCausalLM"


def model_config(hf: dict) -> ModelConfig:
    cfg = common_config(hf, ARCHITECTURE)
    return replace(cfg, max_position_embeddings=cap_to_sliding_window(cfg.max_position_embeddings, hf.get("sliding_window")))
