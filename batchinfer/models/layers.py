"""Shared blocks of the decoder-only families: RMSNorm, fused projections, attention, MLP, layer, causal LM.

One `ModelConfig` (built by a family file from config.json) says everything a family changes:
qkv bias (Qwen2), per-head q/k RMSNorm (Qwen3), tied embeddings, rope. The blocks are written for
the packed layout of the engine (a flat batch of T tokens, no padding, no batch dimension) and
with GPU speed in mind: q/k/v and gate/up are single fused matmuls, rotary uses a cache built once.

On CUDA, RMSNorm (plain, fused add+norm, per-head q/k norm), rotary and SiLU-and-mul run as single
Triton kernels (batchinfer/kernels): one launch and one pass over memory each, instead of the ~6-10
eager float32 ops the reference math takes. On the CPU the plain PyTorch math below is kept, so
greedy float32 outputs stay identical to transformers.

The norms and the activation that feed a projection write the input format that projection
declares (models/linear.py `input_format`): in the model's dtype for a plain Linear, already
quantised per token for an Fp8Linear (kernels/ops.py rms_norm_fp8, fused_add_rms_norm_fp8,
silu_and_mul_fp8: on CUDA the quantisation is fused into the Triton kernel, so no separate
quantisation kernel runs before the FP8 q/k/v, gate/up and down products). The blocks never ask
which one they have: RMSNorm and MLP pick their output path from the consumer at construction.

Parameters are created with torch.empty (no random init): the loader fills every one from the
checkpoint and fails loudly on any it did not fill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from batchinfer.attention.base import AttentionBackend, AttentionMetadata
from batchinfer.kernels import ops
from batchinfer.models.linear import Linear, linear_weight_bytes, make_linear
from batchinfer.models.quant import Fp8Activation, module_kept
from batchinfer.models.rope import RopeConfig, RotaryEmbedding

__all__ = ["Attention", "CausalLM", "DecoderLayer", "Linear", "MLP", "ModelConfig", "RMSNorm"]


@dataclass(frozen=True)
class ModelConfig:
    """The shape and the family flags of one decoder-only model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    quantization: str = "none"  # of the layers' projections: models/linear.py LINEARS
    # with quantization fp8: projections left in the model's dtype (models/quant.py module_kept
    # patterns of checkpoint names: model.fp8_keep and the checkpoint's own ignore list)
    fp8_keep: tuple[str, ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_layer_params(self) -> int:
        """Parameters of all decoder layers (everything but the embeddings, LM head and final norm)."""
        h, qkv = self.hidden_size, self.q_size + 2 * self.kv_size
        per_layer = h * qkv + self.q_size * h + 3 * h * self.intermediate_size + 2 * h
        per_layer += qkv if self.qkv_bias else 0
        per_layer += h if self.o_bias else 0
        per_layer += 2 * self.head_dim if self.qk_norm else 0
        return self.num_layers * per_layer

    def num_params(self) -> int:
        """Parameter count of the model this config builds (tied embeddings counted once)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layer_params() + self.hidden_size

    def projections(self) -> list[tuple[int, int, bool]]:
        """(in_features, out_features, bias) of one layer's fused projections: qkv, o, gate_up, down."""
        h, qkv = self.hidden_size, self.q_size + 2 * self.kv_size
        return [(h, qkv, self.qkv_bias), (self.q_size, h, self.o_bias), (h, 2 * self.intermediate_size, False),
                (self.intermediate_size, h, False)]

    def projection_quantization(self, layer: int, fused: str) -> str:
        """The quantization of one fused projection (FUSED: qkv_proj, o_proj, gate_up_proj, down_proj)
        of decoder layer `layer`: "none" when fp8_keep keeps all its checkpoint modules, else
        `quantization`. ValueError when it keeps only some of them (they are one matmul here)."""
        if self.quantization == "none" or not self.fp8_keep:
            return self.quantization
        names = [f"model.layers.{layer}.{m}" for m in FUSED[fused]]
        kept = [n for n in names if module_kept(n, self.fp8_keep)]
        if kept and len(kept) < len(names):
            raise ValueError(
                f"{', '.join(kept)} kept in 16-bit but not {', '.join(n for n in names if n not in kept)}: "
                f"they are one fused projection ({fused}) here; keep all of them or none"
            )
        return "none" if kept else self.quantization

    def projection_names(self) -> list[str]:
        """Checkpoint module names of every decoder projection (model.layers.N.self_attn.q_proj, ...)."""
        return [name for _, names, _, _ in self._layer_projections() for name in names]

    def kept_projections(self) -> list[str]:
        """Checkpoint module names of the projections fp8_keep leaves in the model's dtype."""
        return [name for _, names, _, q in self._layer_projections() if q != self.quantization for name in names]

    def kept_params(self) -> int:
        """Weights of the projections fp8_keep leaves in the model's dtype (their FLOPs run at the 16-bit rate)."""
        return sum(i * o for _, _, (i, o, _), q in self._layer_projections() if q != self.quantization)

    def _layer_projections(self):
        """(layer, checkpoint module names, (in, out, bias), quantization) of every fused projection
        of every decoder layer, in the order of projections()."""
        for layer in range(self.num_layers):
            for fused, shape in zip(FUSED, self.projections()):
                names = [f"model.layers.{layer}.{m}" for m in FUSED[fused]]
                yield layer, names, shape, self.projection_quantization(layer, fused)

    def weight_bytes(self, dtype_bytes: int) -> int:
        """Bytes of all weights in memory: embeddings, LM head and norms in the model's dtype, the
        projections as `quantization` stores them (FP8: 1 byte a weight plus a float32 scale a row;
        those fp8_keep keeps in the model's dtype)."""
        proj = sum(linear_weight_bytes(q, i, o, b, dtype_bytes) for _, _, (i, o, b), q in self._layer_projections())
        proj_params = sum(i * o + (o if b else 0) for i, o, b in self.projections())
        rest = (self.num_params() - self.num_layers * proj_params) * dtype_bytes
        return rest + proj


# our fused projections -> the checkpoint modules each holds (in the order of projections())
FUSED = {
    "qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "down_proj": ("mlp.down_proj",),
}


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as the reference implementations do), with an optional fused residual add.

    forward(x) -> normed; forward(x, residual) -> (normed(x + residual), x + residual).
    out_format: the input_format of the projection the output feeds (models/linear.py): "dtype"
    returns the normed tensor, "fp8" an Fp8Activation of it (quantised in the same kernel).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, out_format: str = "dtype") -> None:
        super().__init__()
        self.weight = _param(size, dtype=dtype)
        self.eps = eps
        outputs = {"dtype": self._forward_dtype, "fp8": self._forward_fp8}
        if out_format not in outputs:
            raise ValueError(f"RMSNorm out_format must be one of {', '.join(outputs)}, not {out_format!r}")
        self._forward = outputs[out_format]

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self._forward(x, residual)

    def _forward_fp8(self, x: torch.Tensor, residual: torch.Tensor | None):
        if residual is None:
            return Fp8Activation(*ops.rms_norm_fp8(x, self.weight, self.eps), x.dtype)
        (q, scale), residual = ops.fused_add_rms_norm_fp8(x, residual, self.weight, self.eps)
        return Fp8Activation(q, scale, x.dtype), residual

    def _forward_dtype(self, x: torch.Tensor, residual: torch.Tensor | None):
        if x.is_cuda:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class Attention(nn.Module):
    """Fused qkv projection, optional per-head q/k norm, rotary, paged attention, output projection."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, dtype: torch.dtype,
                 layer: int = 0):
        super().__init__()
        self.cfg = cfg
        q = cfg.projection_quantization
        self.qkv_proj = make_linear(q(layer, "qkv_proj"), cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.qkv_bias, dtype)
        self.o_proj = make_linear(q(layer, "o_proj"), cfg.q_size, cfg.hidden_size, cfg.o_bias, dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.rotary = rotary
        self.backend = backend
        self.scale = cfg.head_dim**-0.5
        # (k_scale, v_scale) of this layer's FP8 KV cache (CausalLM.set_kv_scales); None: the backend's
        self.kv_scales: tuple[float, float] | None = None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        cfg = self.cfg
        tokens = positions.shape[0]  # x may be an Fp8Activation (the qkv projection's input format)
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(tokens, cfg.num_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if q.is_cuda:
            # in place: q and k are fresh (norm outputs, or slices of this layer's own qkv output)
            from batchinfer.kernels.rotary import apply_rotary_

            cache = self.rotary.cos_sin_cache
            half = cache.shape[-1] // 2
            q, k = apply_rotary_(q, k, positions, cache[:, :half], cache[:, half:])
        else:
            q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, k_cache, v_cache, meta, self.scale, self.kv_scales)
        return self.o_proj(out.reshape(tokens, cfg.q_size))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one matmul: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, layer: int = 0) -> None:
        super().__init__()
        q = cfg.projection_quantization
        self.gate_up_proj = make_linear(q(layer, "gate_up_proj"), cfg.hidden_size, 2 * cfg.intermediate_size, False, dtype)
        self.down_proj = make_linear(q(layer, "down_proj"), cfg.intermediate_size, cfg.hidden_size, False, dtype)
        # the activation written in the format down_proj takes (models/linear.py input_format)
        self._act = {"dtype": self._act_dtype, "fp8": self._act_fp8}[self.down_proj.input_format]

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        return self.down_proj(self._act(self.gate_up_proj(x)))

    @staticmethod
    def _act_fp8(gate_up: torch.Tensor) -> Fp8Activation:
        return Fp8Activation(*ops.silu_and_mul_fp8(gate_up), gate_up.dtype)

    @staticmethod
    def _act_dtype(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.is_cuda:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks; the residual stream is carried separately (fused add+norm)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, backend: AttentionBackend, dtype: torch.dtype,
                 layer: int = 0):
        super().__init__()
        # layer: this layer's index, which says which projections cfg.fp8_keep keeps in the model's dtype
        attn, mlp = Attention(cfg, rotary, backend, dtype, layer), MLP(cfg, dtype, layer)
        # each norm writes the input format of the projection it feeds (models/linear.py input_format)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, attn.qkv_proj.input_format)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, mlp.gate_up_proj.input_format)
        self.mlp = mlp

    def forward(self, positions, hidden, residual, k_cache, v_cache, meta):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, k_cache, v_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm, LM head (shared with the embedding when tied)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        self.rotary = rotary
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    def set_kv_scales(self, scales: list[tuple[float, float]] | None) -> None:
        """Per layer (k_scale, v_scale) of an FP8 KV cache (engine/kv_calibration.py); None: every
        layer takes its attention backend's one kv_scale again."""
        if scales is not None and len(scales) != len(self.layers):
            raise ValueError(f"{len(scales)} KV scale pairs for {len(self.layers)} layers")
        for i, layer in enumerate(self.layers):
            layer.self_attn.kv_scales = None if scales is None else (float(scales[i][0]), float(scales[i][1]))

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: int64 [T] (packed); returns the final hidden states [T, hidden_size]."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"kv_caches has {len(kv_caches)} entries; the model has {len(self.layers)} layers")
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, k_cache, v_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden_size] -> logits [N, vocab_size] in the model's dtype (into `out` if given).

        Not cast to float32 here: the fused sampler reads bf16 directly (a float32 copy of a
        256 x 152k logits block costs ~0.1 ms a step); the torch sampling path casts for itself."""
        if out is not None:
            return torch.mm(hidden, self.lm_head.t(), out=out)
        return F.linear(hidden, self.lm_head)

    def weight_targets(self) -> dict[str, tuple[torch.Tensor | nn.Module, int, int]]:
        """Checkpoint tensor name -> (destination, first row, number of rows) it is copied into.

        q/k/v land in row ranges of qkv_proj and gate/up in gate_up_proj (fused at load time). The
        weight of a projection names its module (a Linear or an Fp8Linear, which fill themselves:
        `load_rows`); every other destination is a tensor.
        """
        cfg = self.config
        targets: dict[str, tuple[torch.Tensor | nn.Module, int, int]] = {}

        def add(name: str, tensor: torch.Tensor, start: int = 0, rows: int | None = None) -> None:
            targets[name] = (tensor, start, tensor.shape[0] if rows is None else rows)

        def add_proj(name: str, module: nn.Module, start: int = 0, rows: int | None = None) -> None:
            targets[name] = (module, start, module.weight.shape[0] if rows is None else rows)

        add("model.embed_tokens.weight", self.embed_tokens)
        if not cfg.tie_word_embeddings:
            add("lm_head.weight", self.lm_head)
        add("model.norm.weight", self.norm.weight)
        qkv_rows = {"q_proj": (0, cfg.q_size), "k_proj": (cfg.q_size, cfg.kv_size)}
        qkv_rows["v_proj"] = (cfg.q_size + cfg.kv_size, cfg.kv_size)
        inter = cfg.intermediate_size
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for name, (start, rows) in qkv_rows.items():
                add_proj(f"{p}self_attn.{name}.weight", attn.qkv_proj, start, rows)
                if cfg.qkv_bias:
                    add(f"{p}self_attn.{name}.bias", attn.qkv_proj.bias, start, rows)
            add_proj(f"{p}self_attn.o_proj.weight", attn.o_proj)
            if cfg.o_bias:
                add(f"{p}self_attn.o_proj.bias", attn.o_proj.bias)
            if cfg.qk_norm:
                add(f"{p}self_attn.q_norm.weight", attn.q_norm.weight)
                add(f"{p}self_attn.k_norm.weight", attn.k_norm.weight)
            add_proj(f"{p}mlp.gate_proj.weight", mlp.gate_up_proj, 0, inter)
            add_proj(f"{p}mlp.up_proj.weight", mlp.gate_up_proj, inter, inter)
            add_proj(f"{p}mlp.down_proj.weight", mlp.down_proj)
            add(f"{p}input_layernorm.weight", layer.input_layernorm.weight)
            add(f"{p}post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        return targets
