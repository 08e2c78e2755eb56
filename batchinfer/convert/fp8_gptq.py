"""An FP8 checkpoint whose weights are rounded with error compensation (GPTQ), for small models.

`model.quantization: fp8` rounds every weight to its nearest e4m3 value at load (per output channel
scales). On a 135M model that costs accuracy: SmolLM2-135M-Instruct's teacher-forced greedy tokens
agree with float32 at 91.4% of 1,099 answer positions (94.9% with only the activations in FP8).
GPTQ (Frantar et al., 2022) rounds a weight matrix one input column at a time and spreads each
column's rounding error over the columns not yet rounded, weighted by the inverse Hessian of the
layer's inputs on calibration text, so that the layer's OUTPUTS stay close rather than each weight.
The grid is the same one the engine uses (e4m3, per-channel scale amax/448; activations per token),
so the result is an ordinary FP8 checkpoint that the engine loads as it is (compressed-tensors
float-quantized, channel weights, dynamic token activations; config.json quantization_config).

The layers are done in order; each one's inputs are the calibration text run through the layers
before it ALREADY rounded, with its activations rounded per token as the FP8 model will see them
(so later layers compensate earlier layers' error). Columns are taken in order of decreasing Hessian
diagonal ("act order"), in blocks of 128, with 1% dampening: the usual settings.

    batchinfer quantize-fp8 SRC DST --calibration rows.jsonl [--field text] [--samples 64]

Runs on the CPU or a GPU (float32 math, transformers' model classes); BENCHMARKS.md has the
accuracy measured with tests/test_fp8_real.py's workload.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchinfer.models.quant import (
    FP8_DTYPE,
    FP8_MAX,
    module_kept,
    quantize_rows,
    quantize_tokens,
)

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class _Stop(Exception):
    """Raised by the hook that catches the first decoder layer's inputs."""


@dataclass(frozen=True)
class GptqConfig:
    """block: columns rounded together; damp: share of the mean Hessian diagonal added to it;
    act_order: columns in order of decreasing Hessian diagonal."""

    block: int = 128
    damp: float = 0.01
    act_order: bool = True


@dataclass(frozen=True)
class QuantizeReport:
    layers: int
    projections: int
    calibration_tokens: int
    seconds: float
    kept: int = 0  # projections left in 16-bit


def fake_quant_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded to e4m3 with one scale per token, by the engine's own quantisation
    (models/quant.py quantize_tokens), widened back: what the engine's FP8 projections see."""
    q, scale = quantize_tokens(x.reshape(-1, x.shape[-1]))
    return (q.float() * scale).to(x.dtype).reshape(x.shape)


def _round(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w on the e4m3 grid of the given per-row scales (fixed by the original weights while GPTQ
    updates the columns not yet rounded)."""
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def gptq_fp8(w: torch.Tensor, hessian: torch.Tensor, config: GptqConfig = GptqConfig()) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ of one weight W [N, K] against the input Hessian H [K, K] (mean of x x^T) on the e4m3
    grid with per-channel scales: (W_fp8 [N, K] float8_e4m3fn, scale [N, 1] float32)."""
    scale = quantize_rows(w)[1].reshape(-1, 1).double()  # the engine's per-channel scales
    W = w.double().clone()
    H = hessian.double().clone()
    k = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    perm = torch.argsort(torch.diag(H), descending=True) if config.act_order else None
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    H += config.damp * torch.mean(torch.diag(H)) * torch.eye(k, dtype=H.dtype, device=H.device)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    for i1 in range(0, k, config.block):
        i2 = min(i1 + config.block, k)
        w1, err1, h1 = W[:, i1:i2].clone(), torch.zeros_like(W[:, i1:i2]), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = w1[:, i]
            q = _round(col.unsqueeze(1), scale).double().squeeze(1) * scale.squeeze(1)
            Q[:, i1 + i] = q
            e = (col - q) / h1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * h1[i, i:].unsqueeze(0)
            err1[:, i] = e
        W[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    return _round(Q, scale), scale.float()


def _decoder_layers(model: Any) -> Sequence[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers (a decoder-only model of the Llama family is expected)")
    return layers


def _projections(layer: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {n: m for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in PROJECTIONS}


def quantize_fp8_gptq(
    model: Any, calibration: Sequence[Sequence[int]], config: GptqConfig = GptqConfig(),
    progress: Callable[[int, int], None] | None = None, keep: Sequence[str] = (),
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Round every decoder projection of a transformers causal LM (float32, eval mode) with GPTQ;
    returns {module name: (W_fp8, scale [N, 1])} and leaves each projection's weight dequantised
    (the model then computes what the FP8 checkpoint will). calibration: token id lists. keep:
    patterns (models/quant.py module_kept) of projections left as they are, weights and inputs in
    16-bit; the ones after them are calibrated on that."""
    layers = _decoder_layers(model)
    device = next(model.parameters()).device
    inputs: list[tuple[tuple, dict]] = []

    def catch(_mod, args, kwargs):
        inputs.append((args, kwargs))
        raise _Stop

    handle = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.inference_mode():
            for ids in calibration:
                try:
                    model(torch.tensor([list(ids)], device=device), use_cache=False)
                except _Stop:
                    pass
    finally:
        handle.remove()
    prefix = {id(m): n for n, m in model.named_modules()}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    rounded_hooks = []
    try:
        for li, layer in enumerate(layers):
            projs = {n: m for n, m in _projections(layer).items() if not module_kept(f"{prefix[id(layer)]}.{n}", keep)}
            sums = {n: None for n in projs}
            counts = dict.fromkeys(projs, 0)
            last: dict[str, Any] = {"input": None, "h": None}  # q/k/v (gate/up) read one tensor: x^T x once

            def collect(name, sums=sums, counts=counts, last=last):
                def hook(_mod, args):
                    if args[0] is not last["input"]:
                        x = fake_quant_tokens(args[0]).reshape(-1, args[0].shape[-1]).double()
                        last["input"], last["h"] = args[0], x.T @ x
                    h = last["h"]
                    sums[name] = h if sums[name] is None else sums[name] + h
                    counts[name] += args[0].reshape(-1, args[0].shape[-1]).shape[0]
                return hook

            hooks = [m.register_forward_pre_hook(collect(n)) for n, m in projs.items()]
            try:
                _run_layer(layer, inputs)
            finally:
                for h in hooks:
                    h.remove()
                last.clear()
            for n, m in projs.items():
                q, scale = gptq_fp8(m.weight.data, sums[n] / max(1, counts[n]), config)
                m.weight.data = (q.float() * scale).to(m.weight.dtype)
                out[f"{prefix[id(layer)]}.{n}"] = (q.cpu(), scale.cpu())
                rounded_hooks.append(m.register_forward_pre_hook(lambda _m, a: (fake_quant_tokens(a[0]),)))
            inputs = _run_layer(layer, inputs, keep=True)  # the next layer's inputs, through this one rounded
            if progress is not None:
                progress(li + 1, len(layers))
    finally:
        for h in rounded_hooks:
            h.remove()
    return out


def _run_layer(layer: torch.nn.Module, inputs: list[tuple[tuple, dict]], keep: bool = False) -> list[tuple[tuple, dict]]:
    """Run one decoder layer on each caught input; with keep, the inputs of the next layer."""
    nxt = []
    with torch.inference_mode():
        for args, kwargs in inputs:
            y = layer(*args, **kwargs)
            if keep:
                hidden = y[0] if isinstance(y, tuple) else y
                nxt.append(((hidden, *args[1:]), kwargs))
    return nxt


def kept_projections(model: Any, keep: Sequence[str]) -> list[str]:
    """The decoder projections of `model` that the patterns `keep` leave in 16-bit, by module name."""
    layers = _decoder_layers(model)
    prefix = {id(m): n for n, m in model.named_modules()}
    return [f"{prefix[id(layer)]}.{n}" for layer in layers for n in _projections(layer)
            if module_kept(f"{prefix[id(layer)]}.{n}", keep)]


def write_checkpoint(src: Path, dst: Path, model: Any, rounded: dict[str, tuple[torch.Tensor, torch.Tensor]],
                     kept: Sequence[str] = ()) -> None:
    """dst: src's files (config, tokenizer) with the weights of `model`, its rounded projections in
    float8_e4m3fn with their weight_scale, and config.json's compressed-tensors quantization_config,
    whose `ignore` lists lm_head and the projections `kept` in 16-bit (by full module name)."""
    from safetensors.torch import save_file

    if dst.exists() and any(dst.iterdir()):
        raise ValueError(f"{dst}: the output folder exists and is not empty")
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".bin")) and path.name != "model.safetensors.index.json":
            shutil.copy2(path, dst / path.name)
    cfg = json.loads((src / "config.json").read_text())
    # the other tensors (embeddings, norms, biases) in the checkpoint's own dtype: the model was
    # loaded in float32 for the rounding, but a 16-bit checkpoint stays 16-bit there
    dtype = getattr(torch, str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), torch.float32)
    tensors: dict[str, torch.Tensor] = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base in rounded:
            q, scale = rounded[base]
            tensors[name], tensors[f"{base}.weight_scale"] = q.contiguous(), scale.contiguous()
        else:
            t = t.detach().cpu()
            tensors[name] = (t.to(dtype) if t.is_floating_point() and isinstance(dtype, torch.dtype) else t).contiguous()
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True},
        }},
        "ignore": ["lm_head", *kept],
        "batchinfer": {"rounding": "gptq", "act_order": True},
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))


def quantize_checkpoint(src: Path, dst: Path, calibration: Sequence[Sequence[int]], device: str = "cpu",
                        config: GptqConfig = GptqConfig(), progress: Callable[[int, int], None] | None = None,
                        keep: Sequence[str] = ()) -> QuantizeReport:
    """Load src (a Hugging Face folder), round its projections with GPTQ on `calibration` (token id
    lists), write the FP8 checkpoint to dst. keep: patterns of projections left in 16-bit."""
    from transformers import AutoModelForCausalLM

    if not calibration:
        raise ValueError("no calibration text: give at least one row")
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).to(device).eval()
    kept = kept_projections(model, keep)
    if keep and not kept:
        raise ValueError(f"keep: {', '.join(keep)} matches no decoder projection of {src}")
    rounded = quantize_fp8_gptq(model, calibration, config, progress, keep)
    write_checkpoint(src, dst, model, rounded, kept)
    return QuantizeReport(len(_decoder_layers(model)), len(rounded), sum(len(c) for c in calibration),
                          time.perf_counter() - t, len(kept))


def calibration_ids(path: Path, tokenizer: Any, field: str = "text", samples: int = 64, max_tokens: int = 512,
                    chat: bool = True) -> list[list[int]]:
    """Token ids of up to `samples` rows of a JSONL or Parquet file's `field` (a string), each cut to
    max_tokens; chat: each text as a user message through the model's chat template (as a job
    sends its prompts)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path, columns=[field]) if field in pq.read_schema(path).names else None
        if table is None:
            raise ValueError(f"{path}: no column {field!r}")
        texts = table.column(field).to_pylist()[:samples]
    else:
        texts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}, line {n}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get(field), str):
                raise ValueError(f"{path}, line {n}: no string field {field!r}")
            texts.append(row[field])
            if len(texts) >= samples:
                break
    ids = []
    for text in texts:
        if not isinstance(text, str) or not text:
            continue
        if chat:
            out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]
        else:
            out = tokenizer.encode(text)
        ids.append(list(out)[:max_tokens])
    if not ids:
        raise ValueError(f"{path}: no calibration text in field {field!r}")
    return ids
