"""Real model shapes for benchmarks with random weights (no download)."""

from __future__ import annotations

import json
import shutil
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
    "qwen2.5-1.5b": {  # a small-KV shape: 2 KV heads, decodes fast enough to expose the grammar host path
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "qwen2.5-7b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
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


# The tokenizer each shape gets: Qwen's BPE vocabulary, cut to fit where the shape's embedding has fewer
# rows (a text job refuses a tokenizer whose ids a model cannot embed). llama-3.1-8b: the first 128,000
# BPE tokens, then 256 special tokens, <|im_end|> (the EOS) at 128,009 as in the shape's config.
_LLAMA_SPECIALS = (
    ["<|endoftext|>"] + [f"<|reserved_{i}|>" for i in range(7)] + ["<|im_start|>", "<|im_end|>"]
    + [f"<|reserved_{i}|>" for i in range(7, 253)]
)
TOKENIZER_FIT: dict[str, dict] = {"llama-3.1-8b": {"num_ranks": 128000, "specials": _LLAMA_SPECIALS}}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _tokenizer_key(name: str) -> str:
    fit = TOKENIZER_FIT.get(name)
    return "qwen" if fit is None else f"qwen-{fit['num_ranks']}-{len(fit['specials'])}"


def shape_tokenizer(name: str, cache_dir: str | Path) -> Path:
    """The folder of the tokenizer for shape `name`, built once under cache_dir (shapes sharing one share it)."""
    from batchinfer.real_tokenizer import build_qwen_tokenizer

    folder = Path(cache_dir) / "_tokenizers" / _tokenizer_key(name)
    if not (folder / "tokenizer.json").exists():
        tmp = folder.with_name(folder.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        fit = TOKENIZER_FIT.get(name, {})
        build_qwen_tokenizer(tmp, fit.get("num_ranks"), fit.get("specials"))
        tmp.replace(folder)  # complete or absent
    return folder


def write_shape(name: str, out_dir: str | Path) -> Path:
    """A model folder with config.json, generation_config.json and a real tokenizer, no weights.

    Load it with EngineConfig(load_format="random"). The tokenizer is Qwen's vocabulary (151,851 ids):
    it fits the Qwen shapes (all but their padding rows, which decode as empty text); llama-3.1-8b
    (128,256 rows) gets it cut to 128,000 BPE tokens + 256 specials (TOKENIZER_FIT), so that text
    jobs can run on it too. Tokenizers are built once per kind beside out_dir (in `_tokenizers/`).
    """
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; choose from {', '.join(SHAPES)} or give a model folder")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[name], indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": SHAPES[name]["eos_token_id"]}))
    key = out / "_tokenizer_kind"
    if not (out / "tokenizer.json").exists() or not key.exists() or key.read_text() != _tokenizer_key(name):
        src = shape_tokenizer(name, out.parent)
        for f in TOKENIZER_FILES:
            if (src / f).exists():
                shutil.copyfile(src / f, out / f)
        key.write_text(_tokenizer_key(name))
    return out
