"""Our model code: one small file per family, shared blocks in layers.py, loading in loader.py.

ARCHITECTURES maps a config.json architecture name to the family function that turns the config
dict into a ModelConfig; adding a Llama-like family is one file and one line here.
"""

from __future__ import annotations

from typing import Callable

from batchinfer.models import llama, mistral, qwen2, qwen3
from batchinfer.models.layers import CausalLM, ModelConfig

ARCHITECTURES: dict[str, Callable[[dict], ModelConfig]] = {
    llama.ARCHITECTURE: llama.model_config,
    mistral.ARCHITECTURE: mistral.model_config,
    qwen2.ARCHITECTURE: qwen2.model_config,
    qwen3.ARCHITECTURE: qwen3.model_config,
}

__all__ = ["ARCHITECTURES", "CausalLM", "ModelConfig"]
