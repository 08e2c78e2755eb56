"""The projections of the decoder layers (q/k/v, o, gate/up, down), chosen by the model's quantization.

LINEARS maps `model.quantization` to the class: "none" a plain `Linear` in the model's dtype, "fp8"
an `Fp8Linear` (FP8 weights with per-output-channel scales, models/quant.py). Embeddings and the
LM head are never quantised.

`input_format` says what a projection takes, and is the one place the activation path is chosen:
"dtype" (the model's dtype) for Linear, "fp8" for Fp8Linear, which takes an Fp8Activation that the
kernel producing it already quantised per token (models/layers.py: the RMSNorm before q/k/v and
gate/up, the SiLU-and-mul before down; a plain tensor, the o projection's input, is quantised here). Both classes are filled by the loader (models/loader.py): a plain
weight is copied; an FP8 weight is quantised from a float checkpoint's tensor, row range by row
range (the scales are per row, so quantising q, k and v apart equals quantising the fused matrix),
or copied as it is from an FP8 checkpoint together with its `weight_scale` (per tensor: broadcast
over the rows it covers; per channel: copied).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.models.quant import FP8_DTYPE, FP8_MATMULS, Fp8Activation, fp8_matmul_for, quantize_rows


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b), with W allocated but not initialised (the loader fills it)."""

    input_format = "dtype"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_rows(self, start: int, tensor: torch.Tensor) -> None:
        """Fill weight rows [start, start + len(tensor)) from a checkpoint tensor."""
        self.weight[start : start + tensor.shape[0]].copy_(tensor)

    def weight_bytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) with W in float8_e4m3fn [N, K] and one float32 scale per output row [N].

    `matmul` names the FP8 product (models/quant.py FP8_MATMULS); by default the fastest the
    device can run (scaled_mm on a GPU of compute capability >= 8.9 in bfloat16, else dequant).
    The bias (Qwen2's q/k/v) stays in the model's dtype. On the CPU the dequant product keeps a
    copy of the FP8 values widened to the model's dtype (`_float_weight`, made at the first call):
    widening FP8 costs ~10 ns an element there, about a second a forward even for SmolLM2-135M.
    """

    input_format = "fp8"

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, matmul: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.weight = _param(out_features, in_features, dtype=FP8_DTYPE)
        self.weight_scale = _param(out_features, dtype=torch.float32)
        self.bias = _param(out_features, dtype=dtype) if bias else None
        self.matmul = matmul or fp8_matmul_for(self.weight.device, dtype, in_features, out_features)
        if self.matmul not in FP8_MATMULS:
            raise ValueError(f"FP8 matmul must be one of {', '.join(FP8_MATMULS)}, not {self.matmul!r}")
        self._float_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if not isinstance(x, Fp8Activation):
            x = Fp8Activation.of(x)
        w_float = None
        if self.matmul == "dequant" and not self.weight.is_cuda:
            if self._float_weight is None or self._float_weight.dtype != x.dtype:
                self._float_weight = self.weight.to(x.dtype)
            w_float = self._float_weight
        return FP8_MATMULS[self.matmul](x, self.weight, self.weight_scale, self.bias, w_float)

    def load_rows(self, start: int, tensor: torch.Tensor) -> None:
        """Quantise a float checkpoint tensor (per row) into weight rows [start, start + len(tensor))."""
        q, scale = quantize_rows(tensor.to(self.weight.device))
        rows = slice(start, start + tensor.shape[0])
        self.weight[rows].copy_(q)
        self.weight_scale[rows].copy_(scale)
        self._float_weight = None

    def load_fp8_rows(self, start: int, tensor: torch.Tensor) -> None:
        """Copy an FP8 checkpoint tensor as it is (its weight_scale comes with load_scale_rows)."""
        self.weight[start : start + tensor.shape[0]].copy_(tensor)
        self._float_weight = None

    def load_scale_rows(self, start: int, rows: int, scale: torch.Tensor) -> None:
        """An FP8 checkpoint's weight_scale for rows [start, start + rows): one value (per tensor) or one a row."""
        if scale.numel() == 1:
            self.weight_scale[start : start + rows].fill_(float(scale.reshape(())))
        elif scale.numel() == rows:
            self.weight_scale[start : start + rows].copy_(scale.reshape(rows).float())
        else:
            raise ValueError(f"weight_scale has {scale.numel()} values; expected 1 (per tensor) or {rows} (per channel)")

    def weight_bytes(self) -> int:
        return (self.weight.numel() + 4 * self.weight_scale.numel()
                + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, matmul={self.matmul}"


LINEARS: dict[str, type[nn.Module]] = {"none": Linear, "fp8": Fp8Linear}


def make_linear(quantization: str, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> nn.Module:
    """The projection class of `quantization` (LINEARS)."""
    if quantization not in LINEARS:
        raise ValueError(f"quantization must be one of {', '.join(LINEARS)}, not {quantization!r}")
    return LINEARS[quantization](in_features, out_features, bias, dtype)


def linear_weight_bytes(quantization: str, in_features: int, out_features: int, bias: bool, dtype_bytes: int) -> int:
    """Bytes a projection's tensors take, from its shape alone (for sizing before a model is built)."""
    b = out_features * dtype_bytes if bias else 0
    if quantization == "fp8":
        return in_features * out_features + 4 * out_features + b
    return in_features * out_features * dtype_bytes + b
