"""What one engine step costs on the device, from the model's shape and the device's ceilings.

The scheduler's prefill policy (engine/prefill_policy.py) asks it how many prefill tokens a decode
step can take before it grows longer. No GPU is needed: the model is arithmetic.

A step runs its kernels one after another on one stream, and each kernel is held back by its own
bytes or its own FLOPs; kernels do not overlap. So a step's time is the SUM of three parts, each the
larger of its compute and its memory time:

  linear            every projection and MLP over the step's T token rows (T: the padded size of
                    the CUDA graph it replays, when it replays one) plus the LM head over its
                    sampled rows: max(FLOPs / matrix rate, weight bytes / copy bandwidth);
  decode attention  the decode rows against their contexts (C tokens in all): the KV of C is read
                    once: max(4 L Hq d C / matrix rate, C x KV bytes per token / bandwidth);
  extend attention  prefill chunks (the triton backend's second kernel): each query against its
                    context and the chunk's earlier tokens, KV of the whole context read.

The roofline floor (bench/roofline.py) instead takes the max of a whole step's FLOPs and bytes, as
if the decode rows' KV stream and the prefill's matrix work overlapped. In this engine they are
separate launches, so the only slack a decode step has for prefill tokens is in its GEMMs: below the
ridge point (matrix rate / bandwidth x bytes per weight / 2 FLOPs per weight, about 180-200 rows for
16-bit weights on an H200 and the same for FP8, whose rate doubles as its bytes halve) the GEMMs are
memory-bound and extra rows are free; above it every token costs its FLOPs wherever it runs.

Ceilings (`device_ceilings`): the datasheet numbers of the GPU at hand (bench/devices.py; an H200's
when the name is not in the table), or on the CPU a fixed default (CPU_CEILINGS) so the policy is the
same on every machine and testable.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchinfer.bench.roofline import Ceilings

# The CPU's fixed default (not measured: the policy must not depend on the load of a test machine).
CPU_CEILINGS = Ceilings(device="cpu", copy_bytes_per_s=20e9, matmul_flops_per_s=500e9)
NOMINAL_GPU = "NVIDIA H200"  # whose datasheet numbers a GPU not in bench/devices.py's table gets


def device_ceilings(device_type: str, device_name: str | None = None) -> Ceilings:
    """The ceilings the step cost model uses on this device (module docstring)."""
    from batchinfer.bench.devices import datasheet_ceilings

    if device_type != "cuda":
        return CPU_CEILINGS
    found = datasheet_ceilings(device_name, "bfloat16") or datasheet_ceilings(NOMINAL_GPU, "bfloat16")
    assert found is not None
    return found


@dataclass(frozen=True)
class StepCost:
    """The per-step time model (module docstring). Rates are per second, sizes in bytes."""

    layer_flops_per_token: float  # 2 x decoder-layer parameters
    lm_head_flops_per_row: float  # 2 x vocab x hidden, per sampled row
    attn_flops_per_pair: float  # 4 x layers x query heads x head_dim, per (query, key) pair
    weight_bytes: float
    kv_bytes_per_token: float
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    layer_flops_per_s: float  # the projections' rate (FP8's with FP8 weights)

    @classmethod
    def for_model(cls, info, ceilings: Ceilings, kv_dtype_bytes: int) -> StepCost:
        """From a models.loader.ModelInfo, the device's ceilings and the KV cache's bytes an element."""
        fp8 = info.quantization == "fp8"
        rate = ceilings.matmul_flops_per_s
        layer_rate = (ceilings.fp8_matmul_flops_per_s or 2 * rate) if fp8 else rate
        kept = info.fp8_kept_params / max(1, info.num_layer_params) if fp8 else 0.0
        if kept:  # projections kept 16-bit (model.fp8_keep) run at the 16-bit rate: the blended rate
            layer_rate = 1.0 / ((1.0 - kept) / layer_rate + kept / rate)
        kv = 2 * info.num_layers * info.num_kv_heads * info.head_dim * kv_dtype_bytes
        return cls(
            layer_flops_per_token=2.0 * info.num_layer_params,
            lm_head_flops_per_row=2.0 * info.vocab_size * info.hidden_size,
            attn_flops_per_pair=4.0 * info.num_layers * info.num_heads * info.head_dim,
            weight_bytes=float(info.weight_bytes),
            kv_bytes_per_token=float(kv),
            copy_bytes_per_s=ceilings.copy_bytes_per_s,
            matmul_flops_per_s=rate,
            layer_flops_per_s=layer_rate,
        )

    def seconds(
        self, decode_rows: int, decode_context: int, prefill_tokens: int = 0, prefill_context: int = 0,
        padded_tokens: int | None = None,
    ) -> float:
        """A step of `decode_rows` decode rows over `decode_context` context tokens in all, plus one
        prefill chunk of `prefill_tokens` after `prefill_context` computed tokens; `padded_tokens`:
        the token rows the GEMMs run over (a CUDA graph's size), default the step's own tokens."""
        chunks = [(prefill_tokens, prefill_context)] if prefill_tokens else []
        return self.step_seconds(decode_rows, decode_context, chunks, padded_tokens)

    def step_seconds(
        self, decode_rows: int, decode_context: int, chunks: list[tuple[int, int]], padded_tokens: int | None = None,
        sampled: int | None = None,
    ) -> float:
        """The same for a step of several prefill chunks, each (tokens, computed tokens before it);
        sampled: rows that get logits (default: the decode rows and one per chunk)."""
        tokens = padded_tokens if padded_tokens is not None else decode_rows + sum(p for p, _ in chunks)
        sampled = decode_rows + len(chunks) if sampled is None else sampled
        compute = tokens * self.layer_flops_per_token / self.layer_flops_per_s
        compute += sampled * self.lm_head_flops_per_row / self.matmul_flops_per_s
        t = max(compute, self.weight_bytes / self.copy_bytes_per_s)
        if decode_rows:
            t += max(self.attn_flops_per_pair * decode_context / self.matmul_flops_per_s,
                     self.kv_bytes_per_token * decode_context / self.copy_bytes_per_s)
        if chunks:  # one extend launch for all chunks: their tiles run side by side
            pairs = sum(p * c + p * (p + 1) // 2 for p, c in chunks)  # causal: context + the chunk before
            kv = sum(c + p for p, c in chunks)
            t += max(self.attn_flops_per_pair * pairs / self.matmul_flops_per_s,
                     self.kv_bytes_per_token * kv / self.copy_bytes_per_s)
        return t

    def ridge_rows(self) -> int:
        """Token rows at which the linear layers stop being memory-bound (no LM head counted)."""
        return int(self.weight_bytes / self.copy_bytes_per_s * self.layer_flops_per_s / self.layer_flops_per_token)
