"""Llama (2, 3, 3.1+): the base family. attention_bias adds biases to q/k/v and o; rope may be llama3-scaled."""

from __future__ import annotations

from batchinfer.models.hf_config import common_config
from batchinfer.models.layers import ModelConfig

ARCHITECTURE = "LlamaForCausalLM"


def model_config(hf: dict) -> ModelConfig:
    if hf.get("mlp_bias"):
        raise ValueError("config.json: mlp_bias=true is not supported")
    bias = bool(hf.get("attention_bias", False))
    return common_config(hf, ARCHITECTURE, qkv_bias=bias, o_bias=bias)
