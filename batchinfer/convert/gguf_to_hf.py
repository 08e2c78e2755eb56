"""GGUF -> Hugging Face model folder (config.json, model.safetensors, tokenizer files, chat template).

`convert_gguf(path, out)` reads the file (convert/gguf_file.py), dequantises every tensor to
float32, renames llama.cpp's tensor names to Hugging Face's, undoes the q/k row permutation
llama.cpp's converter applies to Llama-layout models (it reorders each head's rows so its rotary
pairs are adjacent; Qwen files keep Hugging Face's order), and writes the folder. The weights are
exactly what transformers' own GGUF loader gives (`from_pretrained(folder, gguf_file=...)`, checked
in tests/test_convert.py; on SmolLM2-135M every tensor is bit-identical too) in a few seconds instead of
about a minute.

The folder is built next to `out` and renamed into place at the end, so a conversion that dies half
way leaves no folder that looks finished. Supported families: llama (also Mistral files, which
llama.cpp writes as llama), mistral, qwen2, qwen3.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batchinfer.convert.gguf_file import GGUFError, GGUFFile

SOURCE_FILE = "batchinfer_source.json"  # written last: what the folder was converted from


@dataclass(frozen=True)
class Family:
    architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp reordered q/k rows (Llama layout)


FAMILIES = {
    "llama": Family("LlamaForCausalLM", "llama", True),
    "mistral": Family("MistralForCausalLM", "mistral", True),
    "qwen2": Family("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": Family("Qwen3ForCausalLM", "qwen3", False),
}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class ConvertResult:
    path: Path
    architecture: str
    num_params: int
    tensor_types: dict[str, int]  # ggml type name -> tensors
    seconds: float
    notes: tuple[str, ...]


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor name (None: not one we know)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k reordering: within each head, rows (pair i, half j) go back to (j, i)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _float32_value(x: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _rope(gguf: GGUFFile, arch: str, context: int) -> tuple[float, dict | None]:
    theta = _float32_value(gguf.get(f"{arch}.rope.freq_base", 10000.0))
    if "rope_freqs.weight" in gguf.tensors:
        raise GGUFError(f"{gguf.path}: per-frequency rope factors (rope_freqs, Llama 3.1 style) are not supported")
    kind = gguf.get(f"{arch}.rope.scaling.type", "none")
    factor = gguf.get(f"{arch}.rope.scaling.factor")
    if kind in ("none", None) or not factor or float(factor) == 1.0:
        return theta, None
    original = gguf.get(f"{arch}.rope.scaling.original_context_length", context)
    if kind == "linear":
        return theta, {"rope_type": "linear", "factor": _float32_value(factor)}
    if kind == "yarn":
        return theta, {"rope_type": "yarn", "factor": _float32_value(factor),
                       "original_max_position_embeddings": int(original)}
    raise GGUFError(f"{gguf.path}: rope scaling {kind!r} is not supported (none, linear and yarn are)")


def hf_config(gguf: GGUFFile, family: Family, arch: str, tied: bool) -> dict:
    """config.json from the file's `<arch>.*` metadata."""

    def need(key: str):
        value = gguf.get(f"{arch}.{key}")
        if value is None:
            raise GGUFError(f"{gguf.path}: metadata {arch}.{key} is missing")
        return value

    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = gguf.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, np.ndarray):  # per-layer counts: all equal in the families we support
        if len(set(kv_heads.tolist())) != 1:
            raise GGUFError(f"{gguf.path}: per-layer KV head counts differ; not supported")
        kv_heads = int(kv_heads[0])
    head_dim = int(gguf.get(f"{arch}.attention.key_length") or gguf.get(f"{arch}.rope.dimension_count") or hidden // heads)
    context = int(need("context_length"))
    vocab = int(gguf.get(f"{arch}.vocab_size") or len(gguf.get("tokenizer.ggml.tokens") or []))
    if not vocab:
        raise GGUFError(f"{gguf.path}: neither {arch}.vocab_size nor a tokenizer vocabulary is in the file")
    theta, scaling = _rope(gguf, arch, context)
    bias = "blk.0.attn_q.bias" in gguf.tensors
    cfg = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "max_position_embeddings": context,
        "rms_norm_eps": _float32_value(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "hidden_act": "silu",
        "tie_word_embeddings": tied,
        "bos_token_id": gguf.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": gguf.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": gguf.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if family.model_type in ("llama", "qwen3"):
        cfg["attention_bias"] = bias
    if family.model_type == "llama":
        cfg["mlp_bias"] = False
    if family.model_type in ("mistral", "qwen2", "qwen3"):
        cfg["sliding_window"] = None
    if family.model_type in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    if family.model_type == "qwen2" and not bias:
        raise GGUFError(f"{gguf.path}: a qwen2 file without q/k/v biases is not a Qwen2 model")
    return cfg


def state_dict(gguf: GGUFFile, family: Family, cfg: dict) -> dict[str, np.ndarray]:
    """Every tensor, dequantised to float32, under its Hugging Face name."""
    out: dict[str, np.ndarray] = {}
    unknown = []
    for name in gguf.tensors:
        target = hf_name(name)
        if target is None:
            unknown.append(name)
            continue
        w = gguf.tensor(name)
        if family.permuted_qk and name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif family.permuted_qk and name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
        out[target] = np.ascontiguousarray(w)
    if unknown:
        raise GGUFError(f"{gguf.path}: {len(unknown)} tensor(s) this converter does not know: {', '.join(unknown[:5])}")
    if "model.embed_tokens.weight" not in out:
        raise GGUFError(f"{gguf.path}: the file has no token_embd.weight")
    return out


def convert_gguf(path: str | Path, out: str | Path, source: dict | None = None) -> ConvertResult:
    """Convert a GGUF file into a Hugging Face folder at `out` (which must not exist yet, or be empty)."""
    from safetensors.numpy import save_file

    from batchinfer.convert.gguf_tokenizer import write_tokenizer

    t0 = time.perf_counter()
    out = Path(out)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()  # an empty folder made beforehand is fine
    if out.exists():
        raise GGUFError(f"{out} already exists; remove it or choose another folder")
    with GGUFFile(path) as gguf:
        arch = gguf.get("general.architecture")
        if arch not in FAMILIES:
            raise GGUFError(
                f"{gguf.path}: architecture {arch!r} is not supported; supported: {', '.join(FAMILIES)}"
            )
        family = FAMILIES[arch]
        tied = "output.weight" not in gguf.tensors
        cfg = hf_config(gguf, family, arch, tied)
        weights = state_dict(gguf, family, cfg)
        types: dict[str, int] = {}
        for name in gguf.tensors:
            types[gguf.type_name(name)] = types.get(gguf.type_name(name), 0) + 1
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.converting-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        try:
            save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp / "model.safetensors", 0o666 & ~umask)  # safetensors writes it owner-only
            tmp.chmod(0o777 & ~umask)
            notes = write_tokenizer(gguf, tmp, cfg["max_position_embeddings"])
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
            gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            num_params = sum(int(w.size) for w in weights.values())
            seconds = time.perf_counter() - t0
            record = {"gguf": str(Path(path).name), "gguf_bytes": Path(path).stat().st_size,
                      "tensor_types": types, "num_params": num_params, "convert_seconds": round(seconds, 2)}
            record.update(source or {})
            (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=2) + "\n")
            tmp.rename(out)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return ConvertResult(out, family.architecture, num_params, types, time.perf_counter() - t0, tuple(notes))
