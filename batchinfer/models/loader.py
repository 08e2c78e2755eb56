"""Loading a Hugging Face checkpoint into our own model code.

A model is a folder (config.json, *.safetensors, optionally sharded with model.safetensors.index.json,
tokenizer files, generation_config.json) or a hub id already in the local HF cache (never downloaded:
batch jobs run offline and must not fetch gigabytes by surprise). Weights are read tensor by tensor
with safetensors.safe_open straight into our (fused) parameters; the transformers model is never
built. Every error a user can cause is a ModelLoadError naming the folder, field or tensor.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from batchinfer.attention.base import AttentionBackend
from batchinfer.models import ARCHITECTURES
from batchinfer.models.layers import CausalLM, ModelConfig
from batchinfer.models.linear import Fp8Linear
from batchinfer.models.quant import (
    FP8_DTYPE,
    QUANTIZATIONS,
    check_keep_patterns,
    checkpoint_keep,
    checkpoint_quantization,
    module_kept,
)

log = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Tensors some checkpoints carry that our model recomputes or does not need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class ModelLoadError(ValueError):
    """The model cannot be found, is not supported, or its files do not match its config."""


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the system needs to know about a model, read from its config files only."""

    architecture: str
    model_dir: Path
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int  # rows of the embedding (may exceed the tokenizer's length)
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]  # config.json and generation_config.json together
    dtype: torch.dtype
    num_params: int
    num_layer_params: int = 0  # decoder layers only (no embeddings / LM head): FLOPs per token
    quantization: str = "none"  # of the decoder layers' projections: none | fp8 (models/linear.py)
    fp8_kept: tuple[str, ...] = ()  # with fp8: the checkpoint modules kept in the model's dtype
    fp8_kept_params: int = 0  # their weights (of num_layer_params)
    weight_bytes: int = 0  # all weights as held in memory (FP8 projections: 1 byte a weight + scales)


def _hub_cache_dir() -> Path:
    """The HF hub cache, read from the environment at call time (HF_HUB_CACHE, then HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _looks_like_path(model: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else that is not a folder is a missing path."""
    return model.startswith((".", "/", "~")) or model.count("/") > 1 or "\\" in model


def resolve_model_dir(model: str) -> Path:
    """A model folder, or the snapshot folder of a hub id in the local HF cache. Never downloads."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model folder {path} has no config.json")
        return path.resolve()
    if path.exists():
        raise ModelLoadError(f"model {model!r} is a file; give the model folder (with config.json)")
    if _looks_like_path(model):
        raise ModelLoadError(f"model folder {model!r} does not exist")
    cache = _hub_cache_dir()
    try:
        from huggingface_hub import snapshot_download

        snapshot = Path(snapshot_download(model, local_files_only=True, cache_dir=str(cache)))
    except Exception as exc:  # huggingface_hub raises several types for "not in the cache" and bad ids
        raise ModelLoadError(
            f"model {model!r} is neither a folder nor a hub id in the local Hugging Face cache ({cache}); "
            f"download it first (e.g. `hf download {model}`) or give its folder"
        ) from exc
    if not (snapshot / "config.json").is_file():
        raise ModelLoadError(f"hub id {model!r}: cached snapshot {snapshot} has no config.json")
    return snapshot


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def _eos_ids(*configs: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for cfg in configs:
        value = cfg.get("eos_token_id")
        for i in value if isinstance(value, list) else [value]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return tuple(ids)


def resolve_dtype(dtype: str, device: torch.device | str, hf: dict) -> torch.dtype:
    """auto: the checkpoint's dtype (config dtype / torch_dtype) on GPU, float32 on CPU."""
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ModelLoadError(f"dtype must be auto, {', '.join(DTYPES)}, not {dtype!r}")
        return DTYPES[dtype]
    if torch.device(device).type == "cpu":
        return torch.float32
    name = hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"
    if name not in DTYPES:
        raise ModelLoadError(f"config.json: dtype {name!r} is not supported; choose {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_quantization(quantization: str, hf: dict, model_dir: Path) -> str:
    """The projections' quantization: `quantization` (none | fp8) for a float checkpoint (fp8:
    quantised at load); fp8 for a checkpoint already in FP8, whatever was asked (it runs as stored).
    ModelLoadError naming the field for an unknown value or an unsupported quantization_config."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"model.quantization must be one of {', '.join(QUANTIZATIONS)}, not {quantization!r}")
    try:
        stored = checkpoint_quantization(hf)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    return stored or quantization


def resolve_keep(fp8_keep: tuple[str, ...] | list[str], hf: dict, model_dir: Path) -> tuple[str, ...]:
    """The patterns of projections kept in the model's dtype under FP8: model.fp8_keep and the
    checkpoint's own list of unquantised modules (models/quant.py checkpoint_keep)."""
    try:
        check_keep_patterns(fp8_keep, "model.fp8_keep")
        stored = checkpoint_keep(hf)
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    return (*fp8_keep, *(p for p in stored if p not in fp8_keep))


def _model_config(model_dir: Path, hf: dict, quantization: str = "none", fp8_keep: tuple[str, ...] = ()) -> ModelConfig:
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{model_dir}: architecture {', '.join(archs) or '(none in config.json)'} is not supported; "
            f"supported: {', '.join(sorted(ARCHITECTURES))}"
        )
    quant = resolve_quantization(quantization, hf, model_dir)
    keep = resolve_keep(fp8_keep, hf, model_dir) if quant == "fp8" else ()
    try:
        cfg = replace(ARCHITECTURES[arch](hf), quantization=quant, fp8_keep=keep)
        kept = cfg.kept_projections()
    except ValueError as exc:
        raise ModelLoadError(f"{model_dir}: {exc}") from exc
    for p in fp8_keep:  # a pattern of the user's that keeps nothing is a typo (the checkpoint's may name lm_head)
        if quant == "fp8" and not any(module_kept(n, (p,)) for n in cfg.projection_names()):
            raise ModelLoadError(f"{model_dir}: model.fp8_keep {p!r} matches no decoder projection "
                                 f"(names such as model.layers.0.self_attn.o_proj; patterns o_proj, layers.0, re:...)")
    if kept:
        log.info("FP8: %d of %d projections kept in the model's dtype (%s)", len(kept), 7 * cfg.num_layers, ", ".join(keep))
    return cfg


def _read_configs(model: str) -> tuple[Path, dict, dict]:
    model_dir = resolve_model_dir(model)
    hf = _read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    gen = _read_json(gen_path) if gen_path.is_file() else {}
    return model_dir, hf, gen


def _info(model_dir: Path, hf: dict, gen: dict, cfg: ModelConfig, dtype: torch.dtype) -> ModelInfo:
    return ModelInfo(
        architecture=cfg.architecture,
        model_dir=model_dir,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        eos_token_ids=_eos_ids(hf, gen),
        dtype=dtype,
        num_params=cfg.num_params(),
        num_layer_params=cfg.num_layer_params(),
        quantization=cfg.quantization,
        fp8_kept=tuple(cfg.kept_projections()),
        fp8_kept_params=cfg.kept_params(),
        weight_bytes=cfg.weight_bytes(dtype.itemsize),
    )


def load_model_info(
    model: str, dtype: str = "auto", device: torch.device | str = "cpu", quantization: str = "none",
    fp8_keep: tuple[str, ...] = (),
) -> ModelInfo:
    """Everything about the model that its config files tell, without reading weights."""
    model_dir, hf, gen = _read_configs(model)
    cfg = _model_config(model_dir, hf, quantization, fp8_keep)
    return _info(model_dir, hf, gen, cfg, resolve_dtype(dtype, device, hf))


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those the index names when sharded, else model*.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (model_dir / name).is_file():
                raise ModelLoadError(f"{model_dir}: shard {name} named in model.safetensors.index.json is missing")
        return [model_dir / f for f in files]
    # Prefer HF's model*.safetensors: some folders also hold the same weights in another layout
    # (e.g. Mistral's consolidated.safetensors).
    files = sorted(model_dir.glob("model*.safetensors")) or sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights (other weight formats are not supported)")
    return files


# Tensors an FP8 checkpoint stores beside a projection's weight: its scale, and a static activation
# scale (read and not used: activations are always scaled per token, at every call).
WEIGHT_SCALE, INPUT_SCALE = ".weight_scale", ".input_scale"


@torch.inference_mode()
def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its place; fail naming any tensor missing, unexpected or misshaped.

    A projection (a module in weight_targets) fills itself: a float tensor into an Fp8Linear is
    quantised per row; an FP8 tensor is copied as it is and needs its `<name>_scale` (weight_scale)."""
    from safetensors import safe_open

    targets = model.weight_targets()
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    needs_scale: set[str] = set()  # FP8 weights copied as stored: their weight_scale must come too
    scaled: set[str] = set()
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name.endswith((WEIGHT_SCALE, INPUT_SCALE)):
                    weight = name.rsplit(".", 1)[0] + ".weight"
                    dest = targets.get(weight, (None,))[0]
                    if not isinstance(dest, Fp8Linear):
                        unexpected.append(name)
                    elif name.endswith(WEIGHT_SCALE):
                        _, start, rows = targets[weight]
                        try:
                            dest.load_scale_rows(start, rows, f.get_tensor(name))
                        except ValueError as exc:
                            raise ModelLoadError(f"{path.name}: tensor {name}: {exc}") from exc
                        scaled.add(weight)
                    continue
                if name not in targets:
                    if not (name.endswith(IGNORED_SUFFIXES) or (tied and name == "lm_head.weight")):
                        unexpected.append(name)
                    continue
                dest, start, rows = targets[name]
                weight_tensor = dest.weight if isinstance(dest, nn.Module) else dest
                expected = (rows, *weight_tensor.shape[1:])
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                if shape != expected:
                    raise ModelLoadError(f"{path.name}: tensor {name} has shape {list(shape)}, expected {list(expected)}")
                tensor = f.get_tensor(name)
                if tensor.dtype == FP8_DTYPE:
                    if not isinstance(dest, Fp8Linear):
                        why = ("config.json has no FP8 quantization_config" if model.config.quantization != "fp8"
                               else "only the decoder layers' projections can be FP8" if not isinstance(dest, nn.Module)
                               else "model.fp8_keep or the quantization_config's ignore list keeps it in 16-bit")
                        raise ModelLoadError(f"{path.name}: tensor {name} is FP8 but {why}")
                    dest.load_fp8_rows(start, tensor)
                    needs_scale.add(name)
                elif tensor.dtype.is_floating_point and tensor.element_size() == 1:
                    raise ModelLoadError(f"{path.name}: tensor {name} is {tensor.dtype}; only float8_e4m3fn FP8 weights are supported")
                elif isinstance(dest, nn.Module):
                    dest.load_rows(start, tensor)
                else:
                    dest[start : start + rows].copy_(tensor)
                loaded.add(name)
    if unexpected:
        shown = ", ".join(sorted(unexpected)[:5])
        raise ModelLoadError(f"{model_dir}: {len(unexpected)} unexpected tensor(s) in the checkpoint: {shown}")
    missing = sorted(set(targets) - loaded)
    if missing:
        shown = ", ".join(missing[:5])
        raise ModelLoadError(f"{model_dir}: {len(missing)} tensor(s) missing from the checkpoint: {shown}")
    unscaled = sorted(needs_scale - scaled)
    if unscaled:
        shown = ", ".join(n.removesuffix(".weight") + WEIGHT_SCALE for n in unscaled[:5])
        raise ModelLoadError(f"{model_dir}: {len(unscaled)} FP8 weight(s) without their scale in the checkpoint: {shown}")


def init_random_weights(model: CausalLM, seed: int = 0, std: float = 0.02) -> None:
    """Fill every weight with random values of a trained model's scale (norm weights 1, biases 0).

    For benchmarks of real shapes without a checkpoint (EngineConfig.load_format="random").
    """
    gen = torch.Generator(device=model.device).manual_seed(seed)
    seen: set[int] = set()
    for name, (tensor, _, _) in model.weight_targets().items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if isinstance(tensor, nn.Module):  # a projection: random float rows, quantised if it is FP8
            rows = torch.empty(tensor.weight.shape, dtype=model.dtype, device=model.device).normal_(0.0, std, generator=gen)
            tensor.load_rows(0, rows)
        elif "norm" in name:
            tensor.fill_(1.0)
        elif name.endswith(".bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, std, generator=gen)


def load_model(
    model: str,
    dtype: str,
    device: torch.device | str,
    attention: AttentionBackend,
    load_format: str = "safetensors",
    quantization: str = "none",
    fp8_keep: tuple[str, ...] = (),
) -> tuple[CausalLM, ModelInfo]:
    """Build our model for `model` (folder or cached hub id) on `device`.

    load_format "safetensors" reads the checkpoint; "random" fills the config's shapes with random
    weights (benchmarks without a download; the folder needs no weight files). quantization fp8:
    the decoder layers' projections in FP8 (resolve_quantization), but those fp8_keep names and
    those the checkpoint's quantization_config leaves unquantised (resolve_keep).
    """
    model_dir, hf, gen = _read_configs(model)
    cfg = _model_config(model_dir, hf, quantization, fp8_keep)
    torch_dtype = resolve_dtype(dtype, device, hf)
    with torch.device(device):
        net = CausalLM(cfg, attention, torch_dtype)
    if load_format == "random":
        with torch.no_grad():
            init_random_weights(net)
    elif load_format == "safetensors":
        load_weights(net, model_dir)
    else:
        raise ModelLoadError(f"load_format must be safetensors or random, not {load_format!r}")
    net.eval()
    return net, _info(model_dir, hf, gen, cfg, torch_dtype)


def load_tokenizer(model_dir: Path):
    """The model's fast tokenizer, from local files only: models.tokenizer.FastTokenizer (no
    transformers import) where it reads the folder exactly as transformers would, else transformers'."""
    from batchinfer.models.tokenizer import FastTokenizer, unsupported

    if unsupported(Path(model_dir)) is None:
        try:
            return FastTokenizer(model_dir)
        except Exception as exc:  # noqa: BLE001 (a file tokenizers cannot read: say so below, via transformers)
            log.debug("%s: tokenizer.json not readable by tokenizers (%s); using transformers", model_dir, exc)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), use_fast=True, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir}: cannot load the tokenizer: {exc}") from exc
