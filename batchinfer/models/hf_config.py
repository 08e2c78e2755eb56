"""Reading the fields every supported family shares from a config.json dict, with clear errors."""

from __future__ import annotations

from batchinfer.models.layers import ModelConfig
from batchinfer.models.rope import rope_config_from_hf


def _required(hf: dict, key: str):
    if hf.get(key) is None:
        raise ValueError(f"config.json: missing required field {key!r}")
    return hf[key]


def common_config(hf: dict, architecture: str, **flags) -> ModelConfig:
    """The ModelConfig of a Llama-like decoder; `flags` are the family's switches (qkv_bias, qk_norm, ...).

    Raises ValueError naming the config.json field for anything missing or unsupported.
    """
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json: hidden_act {act!r} is not supported (only silu)")
    hidden = int(_required(hf, "hidden_size"))
    heads = int(_required(hf, "num_attention_heads"))
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise ValueError(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    head_dim = int(hf.get("head_dim") or hidden // heads)
    max_pos = int(_required(hf, "max_position_embeddings"))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(_required(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_required(hf, "intermediate_size")),
        num_layers=int(_required(hf, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope_config_from_hf(hf),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **flags,
    )


def cap_to_sliding_window(cfg_max_pos: int, window: int | None) -> int:
    """We attend over the full context; that equals sliding-window attention only while the context
    fits in the window, so a model with a window gets its usable context capped at the window."""
    return min(cfg_max_pos, int(window)) if window else cfg_max_pos
