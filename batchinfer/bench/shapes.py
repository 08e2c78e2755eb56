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


def _qwen2(hidden, inter, layers, heads, kv, tied, vocab=151936, **extra) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "tie_word_embeddings": tied, "hidden_act": "silu", "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645, **extra,
    }


def _llama3(hidden, inter, layers, heads, kv, head_dim, tied, rope_factor) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv, "head_dim": head_dim, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": rope_factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "tie_word_embeddings": tied, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128009,
    }


# More released shapes (their published config.json, as far as the engine reads it), for the shape
# matrix (MATRIX below, `bench matrix`): GQA groups 1-8, head_dim 64 and 128, 2-16 KV heads, hidden
# 576-8192, tied and untied embeddings.
SHAPES.update({
    # SmolLM2-135M: 9 query / 3 KV heads of 64, tied. Its EOS is the cut Qwen tokenizer's <|im_end|>
    # (TOKENIZER_FIT; the released tokenizer has it at id 2): random weights never emit it anyway.
    "smollm2-135m": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
        "torch_dtype": "bfloat16", "bos_token_id": 49001, "eos_token_id": 49002,
    },
    "qwen2.5-0.5b": _qwen2(896, 4864, 24, 14, 2, True),  # group 7, head_dim 64
    "qwen1.5-0.5b": _qwen2(1024, 2816, 24, 16, 16, True),  # multi-head attention (group 1), head_dim 64
    "qwen2.5-3b": _qwen2(2048, 11008, 36, 16, 2, True),  # group 8, head_dim 128
    "llama-3.2-1b": _llama3(2048, 8192, 16, 32, 8, 64, True, 32.0),  # group 4, head_dim 64
    "llama-3.2-3b": _llama3(3072, 8192, 28, 24, 8, 128, True, 32.0),  # group 3
    "qwen3-8b": {
        **SHAPES["qwen3-0.6b"], "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False,
    },
    # Llama-3.1-70B's layer (hidden 8192, 64 query / 8 KV heads, MLP 28672) with 20 of its 80 layers:
    # 19.2e9 parameters, 38 GB in bf16, so that one H200 holds it with room for the KV cache (all 80
    # layers, 141 GB, do not fit). Per-layer shapes, the LM head and the embedding are the real ones.
    "llama-3.1-70b-20l": _llama3(8192, 28672, 20, 64, 8, 128, False, 8.0),
})

# The shape matrix every decode/throughput change is judged on (`batchinfer bench matrix`,
# scripts/decode_shape_sweep.py), smallest first.
MATRIX = (
    "smollm2-135m", "qwen2.5-0.5b", "qwen1.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "qwen2.5-1.5b", "qwen2.5-3b",
    "llama-3.2-3b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-8b", "llama-3.1-70b-20l",
)


# The tokenizer each shape gets: Qwen's BPE vocabulary, cut to fit where the shape's embedding has fewer
# rows (a text job refuses a tokenizer whose ids a model cannot embed). llama-3.1-8b: the first 128,000
# BPE tokens, then 256 special tokens, <|im_end|> (the EOS) at 128,009 as in the shape's config.
_LLAMA_SPECIALS = (
    ["<|endoftext|>"] + [f"<|reserved_{i}|>" for i in range(7)] + ["<|im_start|>", "<|im_end|>"]
    + [f"<|reserved_{i}|>" for i in range(7, 253)]
)
# smollm2-135m (49,152 rows): the first 49,000 BPE tokens, then 152 specials (<|im_start|> at 49,001,
# <|im_end|> at 49,002 as in its shape).
_SMOLLM_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|reserved_{i}|>" for i in range(149)]
_LLAMA_FIT = {"num_ranks": 128000, "specials": _LLAMA_SPECIALS}
TOKENIZER_FIT: dict[str, dict] = {
    **{name: _LLAMA_FIT for name, c in SHAPES.items() if c["vocab_size"] == 128256},
    "smollm2-135m": {"num_ranks": 49000, "specials": _SMOLLM_SPECIALS},
}
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
