"""FP8 (float8_e4m3fn) numerics and the FP8 matrix products, chosen by name.

Weights: one scale per output channel (row of W [N, K]), scale = amax(|row|) / 448 (448 is the
largest finite e4m3 value), W_fp8 = round(W / scale). Activations: one scale per token (row of
x [T, K]), computed at every call the same way (dynamic). The product is then

    y = (x_fp8 @ W_fp8^T) * x_scale[T, 1] * w_scale[1, N]  (+ bias)

Two matrix-product backends compute exactly that, by name (FP8_MATMULS):
  scaled_mm: torch._scaled_mm on CUDA GPUs of compute capability >= 8.9 (Ada, Hopper) with
      row-wise scales (scale_a [T, 1], scale_b [1, N], float32; bfloat16 output; K and N
      multiples of 16: torch's requirement); FP8 tensor cores, float32 accumulation.
  scaled_mm_fast: the same with use_fast_accum (Hopper's FP8 accumulator promoted to float32 less
      often): faster, less exact; chosen by name only, never by default.
  dequant: the FP8 values widened to the model's dtype and multiplied by an ordinary matmul, the
      scales applied to the result; everywhere else (CPU, older GPUs, other output dtypes). The
      activations are quantised the same way first, so both compute the same math up to the
      order of accumulation.
`fp8_matmul_for(device, dtype, in_features, out_features)` picks one; callers never ask which.

Checkpoints already in FP8 (config.json quantization_config): `checkpoint_quantization` reads the
common formats (quant_method "fp8", and compressed-tensors float8 with tensor or channel weight
scales) and refuses every other one with a message naming the field; `checkpoint_keep` reads the
modules such a checkpoint leaves unquantised (compressed-tensors `ignore`; quant_method fp8's
`modules_to_not_convert` or `ignored_layers`), which the engine then runs in the model's dtype.
`module_kept` is the one rule that matches those names and model.fp8_keep's patterns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from batchinfer.kernels import ops, reference

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = reference.FP8_MAX  # 448, the largest finite e4m3 value
QUANTIZATIONS = ("none", "fp8")

# x [R, C] (any float dtype) -> (x_fp8 [R, C] float8_e4m3fn, scale [R] float32), one scale a row:
# scale = amax(|row|) / 448, x_fp8 = x / scale (every row's largest value maps to +-448)
quantize_rows = reference.quantize_fp8_rows


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_rows: q [R, C] FP8, scale [R] (or a scalar) -> q * scale in `dtype`."""
    s = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(())
    return (q.float() * s).to(dtype)


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [T, K] -> (x_fp8 [T, K], scale [T, 1] float32): dynamic per-token scales
    (one fused Triton kernel on CUDA, kernels/fp8_quant.py; the same math in PyTorch elsewhere)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return ops.quantize_fp8_tokens(x)


@dataclass(frozen=True)
class Fp8Activation:
    """An activation already quantised per token, the input of an FP8 projection (Fp8Linear).

    The kernel that produces the activation writes it so (the RMSNorm before q/k/v and gate/up,
    the SiLU-and-mul before down: kernels/ops.py *_fp8), instead of writing it in the model's dtype
    for the projection to read and quantise again. `dtype`: the model's dtype, the product's output."""

    q: torch.Tensor  # [T, K] float8_e4m3fn
    scale: torch.Tensor  # [T, 1] float32
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor) -> "Fp8Activation":
        """Quantise an activation in the model's dtype (quantize_tokens)."""
        q, scale = quantize_tokens(x)
        return cls(q, scale, x.dtype)


def module_kept(name: str, patterns: Sequence[str]) -> bool:
    """Whether the module `name` (a checkpoint name, e.g. model.layers.0.self_attn.o_proj) is kept
    in 16-bit by one of `patterns`: "re:REGEX" matches from the start of the name (compressed-tensors'
    `ignore` rule); any other pattern matches a whole run of the name's dotted parts, so "o_proj"
    keeps every o projection, "layers.0" all of layer 0 and a full name just that module."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif f".{p}." in f".{name}.":
            return True
    return False


def check_keep_patterns(patterns: Sequence[str], field: str) -> None:
    """ValueError naming `field` for a pattern that is empty, not a string, or a bad "re:" regex."""
    for p in patterns:
        if not isinstance(p, str) or not p.strip(". ") or p == "re:":
            raise ValueError(f"{field}: {p!r} is not a module name or pattern")
        if p.startswith("re:"):
            try:
                re.compile(p[3:])
            except re.error as exc:
                raise ValueError(f"{field}: {p!r} is not a valid regular expression ({exc})") from None


# --- the matrix products -----------------------------------------------------------------------

# (x: the activation quantised per token, w_fp8 [N, K], w_scale [N] float32, bias [N] | None,
# w_float [N, K] | None) -> y [T, N] in x.dtype. w_float: the FP8 values already widened to x's
# dtype (the dequant backend's cache on the CPU), or None.
Fp8Matmul = Callable[[Fp8Activation, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"], torch.Tensor]


def _scaled_mm_with(fast_accum: bool) -> Fp8Matmul:
    def run(x: Fp8Activation, w_fp8, w_scale, bias, w_float=None):
        # _scaled_mm wants mat2 column-major: w_fp8 is row-major [N, K], so its transpose [K, N] is.
        # The bias is added after, in x's dtype, as the dequant backend adds it.
        y = torch._scaled_mm(
            x.q, w_fp8.t(), scale_a=x.scale, scale_b=w_scale.view(1, -1), out_dtype=x.dtype, use_fast_accum=fast_accum
        )
        y = y[0] if isinstance(y, tuple) else y  # torch < 2.5 returned (out, amax)
        return y + bias if bias is not None else y

    return run


def _dequant(x: Fp8Activation, w_fp8, w_scale, bias, w_float=None):
    w = w_float if w_float is not None else w_fp8.to(x.dtype)
    y = torch.nn.functional.linear(x.q.to(x.dtype), w)
    y = (y.float() * x.scale * w_scale.view(1, -1)).to(x.dtype)
    return y + bias if bias is not None else y


FP8_MATMULS: dict[str, Fp8Matmul] = {
    "scaled_mm": _scaled_mm_with(fast_accum=False),  # float32 accumulation throughout
    "scaled_mm_fast": _scaled_mm_with(fast_accum=True),  # Hopper's fast accumulation (fewer promotions to float32)
    "dequant": _dequant,
}


def scaled_mm_supported(device: torch.device) -> bool:
    """torch._scaled_mm with row-wise scales runs here: a CUDA GPU of compute capability >= 8.9."""
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_matmul_for(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int) -> str:
    """The backend name for a layer: scaled_mm where the FP8 tensor cores can take it, else dequant."""
    if scaled_mm_supported(device) and dtype == torch.bfloat16 and in_features % 16 == 0 and out_features % 16 == 0:
        return "scaled_mm"
    return "dequant"


# --- checkpoints already in FP8 --------------------------------------------------------------


def checkpoint_quantization(hf: dict) -> str | None:
    """None for an unquantised checkpoint, "fp8" for one in a supported FP8 format.

    Raises ValueError naming the config.json field for any other quantization_config."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError("config.json: quantization_config must be an object")
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size"):
            raise ValueError(
                "config.json: quantization_config.weight_block_size (block-wise FP8 scales) is not supported; "
                "per-tensor and per-channel FP8 checkpoints are"
            )
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "float8_e4m3fn"):
            raise ValueError(f"config.json: quantization_config.fmt {fmt!r} is not supported (only e4m3)")
        return "fp8"
    if method == "compressed-tensors":
        _check_compressed_tensors(qc)
        return "fp8"
    raise ValueError(
        f"config.json: quantization_config.quant_method {method!r} is not supported "
        "(FP8 checkpoints are: quant_method fp8, or compressed-tensors float8)"
    )


# the quantization_config keys that list modules left unquantised, by quant_method
KEEP_KEYS = {"compressed-tensors": ("ignore",), "fp8": ("modules_to_not_convert", "ignored_layers")}


def checkpoint_keep(hf: dict) -> tuple[str, ...]:
    """The module patterns (module_kept) a quantised checkpoint's quantization_config leaves
    unquantised; () for none. ValueError naming the field when one is not a list of strings."""
    qc = hf.get("quantization_config")
    if not isinstance(qc, dict):
        return ()
    out: list[str] = []
    for key in KEEP_KEYS.get(qc.get("quant_method"), ()):
        value = qc.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"config.json: quantization_config.{key} must be a list of module names")
        check_keep_patterns(value, f"config.json: quantization_config.{key}")
        out += [v for v in value if v not in out]
    return tuple(out)


def _check_compressed_tensors(qc: dict) -> None:
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise ValueError(
            f"config.json: quantization_config.format {fmt!r} (compressed-tensors) is not supported; "
            "only float-quantized (float8) checkpoints are"
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ValueError("config.json: quantization_config.config_groups (compressed-tensors) is empty")
    for name, group in groups.items():
        w = (group or {}).get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise ValueError(
                f"config.json: quantization_config.config_groups.{name}.weights must be 8-bit float "
                f"(got num_bits {w.get('num_bits')!r}, type {w.get('type')!r})"
            )
        if w.get("strategy") not in ("tensor", "channel"):
            raise ValueError(
                f"config.json: quantization_config.config_groups.{name}.weights.strategy {w.get('strategy')!r} "
                "is not supported (tensor or channel)"
            )
