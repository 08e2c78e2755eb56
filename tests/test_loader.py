"""The loader: model info from config files, the local HF cache, and clear errors for what a user gets wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchinfer.attention import get_attention_backend
from batchinfer.models.loader import (
    ModelInfo,
    ModelLoadError,
    load_model,
    load_model_info,
    load_tokenizer,
    resolve_model_dir,
)


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def load(path) -> tuple:
    return load_model(str(path), "float32", "cpu", get_attention_backend("torch", "cpu"))


def test_model_info_from_config_only(tiny_model):
    info = load_model_info(str(tiny_model))
    assert isinstance(info, ModelInfo)
    config = json.loads((tiny_model / "config.json").read_text())
    gen = json.loads((tiny_model / "generation_config.json").read_text())
    assert info.architecture == "Qwen3ForCausalLM"
    assert info.model_dir == tiny_model.resolve()
    assert (info.num_layers, info.num_heads, info.num_kv_heads) == (2, 4, 2)
    assert (info.head_dim, info.hidden_size, info.intermediate_size) == (32, 64, 128)
    assert info.vocab_size == config["vocab_size"]
    assert info.max_position_embeddings == 2048
    assert set(info.eos_token_ids) == {config["eos_token_id"], *gen["eos_token_id"]}
    assert len(info.eos_token_ids) == len(set(info.eos_token_ids))
    assert info.dtype == torch.float32  # auto on CPU
    assert load_model_info(str(tiny_model), "bfloat16").dtype == torch.bfloat16
    assert load_model_info(str(tiny_model), "auto", device="cuda").dtype == torch.float32  # the checkpoint's dtype


def test_model_info_works_without_weights(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path / "m")
    (path / "model.safetensors").unlink()
    edit_config(path, dtype="bfloat16")
    info = load_model_info(str(path), device="cuda:0")
    assert info.dtype == torch.bfloat16
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load(path)


def test_model_info_matches_loaded_model(family_model):
    _, path = family_model
    model, info = load(path)
    assert info == load_model_info(str(path))
    assert info.num_params == sum(p.numel() for p in model.parameters())


def test_tokenizer_loads_locally(tiny_model):
    tok = load_tokenizer(tiny_model)
    assert tok.is_fast
    assert tok.convert_tokens_to_ids("<|im_end|>") in load_model_info(str(tiny_model)).eos_token_ids
    assert tok.decode(tok.encode("invoice total 42")) == "invoice total 42"


def test_unsupported_architecture(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path / "m")
    edit_config(path, architectures=["GPT2LMHeadModel"])
    for call in (lambda: load_model_info(str(path)), lambda: load(path)):
        with pytest.raises(ModelLoadError, match="GPT2LMHeadModel is not supported") as err:
            call()
        for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            assert arch in str(err.value)


def test_unsupported_config_values(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path / "m")
    edit_config(path, rope_parameters={"rope_type": "longrope", "rope_theta": 1.0})
    with pytest.raises(ModelLoadError, match="rope type 'longrope' is not supported"):
        load_model_info(str(path))
    edit_config(path, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, hidden_act="gelu")
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu'"):
        load_model_info(str(path))
    edit_config(path, hidden_act="silu", num_hidden_layers=None)
    with pytest.raises(ModelLoadError, match="num_hidden_layers"):
        load_model_info(str(path))


def test_missing_folder_and_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="'some-org/not-cached'.*local Hugging Face cache"):
        load_model_info("some-org/not-cached")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model_dir(str(tmp_path / "empty"))


def test_hub_id_resolves_from_local_cache(tiny_model, tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--acme--tiny-qwen"
    snapshot = copy_model(tiny_model, repo / "snapshots" / "0123abcd")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("acme/tiny-qwen") == snapshot
    model, info = load(str("acme/tiny-qwen"))
    assert info.model_dir == snapshot and info.architecture == "Qwen3ForCausalLM"
    with pytest.raises(ModelLoadError, match="acme/other"):
        resolve_model_dir("acme/other")


def rewrite_weights(path: Path, change) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path / "m")
    rewrite_weights(path, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ModelLoadError, match="missing.*model.layers.1.self_attn.k_norm.weight"):
        load(path)


def test_mismatched_tensor(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path / "m")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(3, 64)}))
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.up_proj.weight has shape \[3, 64\], expected \[128, 64\]"):
        load(path)


def test_unexpected_tensor(tiny_model, tmp_path):
    path = copy_model(tiny_model, tmp_path / "m")
    rewrite_weights(path, lambda t: t.update({"model.layers.0.mlp.gate_proj.weight_scale": torch.ones(1)}))
    with pytest.raises(ModelLoadError, match="unexpected.*gate_proj.weight_scale"):
        load(path)


def test_missing_shard(model_factory, tmp_path):
    path = copy_model(model_factory("llama", max_shard_size="100KB"), tmp_path / "m")
    (path / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00006.safetensors"):
        load(path)
