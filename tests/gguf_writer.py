"""Write a small Hugging Face model as a GGUF file the way llama.cpp's converter lays one out.

For tests of convert-gguf: the demo models (random weights, a trained byte-level BPE tokenizer)
become GGUF files with quantised tensors (Q8_0, Q4_1), half-precision ones (F16, BF16) and float32
norms; Llama-layout q/k rows are permuted as llama.cpp does (each head's rotary halves interleaved);
the tokenizer goes in as llama.cpp's `gpt2` metadata. transformers' own GGUF loader then gives an
independent reading of the same file to compare our converter with.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# tensor kind -> ggml type used in the test files (a mix, so every reader path runs)
TYPES = {"embed": "Q8_0", "attn": "Q4_1", "mlp": "F16", "down": "BF16", "norm": "F32", "bias": "F32", "head": "Q8_0"}


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k reordering: within each head, rows (half j, pair i) go to (pair i, half j)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str) -> tuple[str, str]:
    """(llama.cpp name, kind) of a Hugging Face tensor name."""
    glob = {"model.embed_tokens.weight": ("token_embd.weight", "embed"), "model.norm.weight": ("output_norm.weight", "norm"),
            "lm_head.weight": ("output.weight", "head")}
    if hf in glob:
        return glob[hf]
    _, _, i, rest = hf.split(".", 3)
    table = {
        "input_layernorm.weight": ("attn_norm.weight", "norm"), "post_attention_layernorm.weight": ("ffn_norm.weight", "norm"),
        "self_attn.q_proj.weight": ("attn_q.weight", "attn"), "self_attn.k_proj.weight": ("attn_k.weight", "attn"),
        "self_attn.v_proj.weight": ("attn_v.weight", "attn"), "self_attn.o_proj.weight": ("attn_output.weight", "attn"),
        "self_attn.q_proj.bias": ("attn_q.bias", "bias"), "self_attn.k_proj.bias": ("attn_k.bias", "bias"),
        "self_attn.v_proj.bias": ("attn_v.bias", "bias"),
        "self_attn.q_norm.weight": ("attn_q_norm.weight", "norm"), "self_attn.k_norm.weight": ("attn_k_norm.weight", "norm"),
        "mlp.gate_proj.weight": ("ffn_gate.weight", "mlp"), "mlp.up_proj.weight": ("ffn_up.weight", "mlp"),
        "mlp.down_proj.weight": ("ffn_down.weight", "down"),
    }
    name, kind = table[rest]
    return f"blk.{i}.{name}", kind


def write_gguf(model_dir: Path, out: Path, arch: str) -> Path:
    """Write model_dir (a demo model of family `arch`) as a GGUF file at `out`."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q
    from safetensors.numpy import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta")))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    # tokenizer (llama.cpp's gpt2 kind): tokens by id, control tokens marked, merges as "a b"
    vocab = dict(tok["model"]["vocab"])
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [None] * cfg["vocab_size"]
    for t, i in vocab.items():
        tokens[i] = t
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    special = {a["content"] for a in tok["added_tokens"] if a["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "default")  # as llama.cpp names them
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(tok_cfg.get("chat_template") or (model_dir / "chat_template.jinja").read_text())
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for name, value in state.items():
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        gname, kind = _gguf_name(name)
        value = value.astype(np.float32)
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_q.bias")):
            value = permute_rows(value, heads)
        elif arch == "llama" and gname.endswith(("attn_k.weight", "attn_k.bias")):
            value = permute_rows(value, kv_heads)
        qtype = Q[TYPES[kind]] if value.ndim == 2 else Q.F32
        if qtype == Q.F32:
            w.add_tensor(gname, value)
        elif qtype == Q.F16:
            w.add_tensor(gname, value.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
