"""Real model shapes for benchmarks with random weights (no download)."""

from __future__ import annotations

import json
from pathlib import Path

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 128000,
        "eos_token_id": 128009,
    },
}


def write_shape(name: str, out_dir: str | Path) -> Path:
    """A model folder with config.json, generation_config.json and a real (Qwen) tokenizer, no weights.

    Load it with EngineConfig(load_format="random"). The Qwen vocabulary (151,851 ids) covers every id
    of the llama-3.1-8b shape (128,256 rows) and all but the 85 padding rows of qwen3-0.6b (151,936 rows),
    which decode as empty text.
    """
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)} or give a model folder")
    from batchinfer.real_tokenizer import build_qwen_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": SHAPES[name]["eos_token_id"]}))
    if not (out / "tokenizer.json").exists():
        build_qwen_tokenizer(out)
    return out
