"""The roofline floor of a generation workload on a device.

Two ceilings are measured at start (a large device-to-device copy, counting bytes read plus written;
a large matrix product in the model's dtype), and a third where the device has FP8 tensor cores
(a large torch._scaled_mm with row-wise scales, as models/quant.py runs FP8 projections). The
workload's FLOPs over the matrix rate and its fewest bytes over the copy bandwidth give two times;
the larger is the floor: no engine runs it faster. With FP8 projections (model.quantization fp8)
their FLOPs go at the FP8 rate (`layer_flops_per_s`; the LM head and attention stay 16-bit) and the
weights are the FP8 bytes. Counting (documented so that the floor can be checked by hand):

FLOPs: 2 x (parameters of the decoder layers) per token processed (prompt and output), 2 x V x H
  for the LM head per sampled token, and 4 x L x heads x head_dim x context per token for attention
  (QK^T and PV; causal prefill counts each earlier position once).
Bytes: every weight read once per decode step, with the fewest steps any schedule needs
  (max(longest output, total output / concurrency), concurrency bounded by the requests and the KV
  memory); each output token reads its whole context's KV once; every token's KV is written once.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from batchinfer.io.model_files import kv_bytes_per_token


@dataclass(frozen=True)
class Ceilings:
    device: str
    copy_bytes_per_s: float
    matmul_flops_per_s: float
    fp8_matmul_flops_per_s: float | None = None  # FP8 tensor cores (torch._scaled_mm); None: none here


@dataclass(frozen=True)
class Floor:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    floor_s: float
    bound: str  # "memory" or "compute"
    concurrency: int
    min_steps: int

    def as_dict(self) -> dict:
        return asdict(self)


def _time_cuda(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def _time_host(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def measure_ceilings(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    """Median of repeated runs: copy bandwidth (read + write) and matrix rate on random data."""
    cuda = device.type == "cuda"
    n_bytes = (2 << 30) if cuda else (128 << 20)
    src = torch.randn(n_bytes // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    timer = _time_cuda if cuda else _time_host
    t_copy = timer(lambda: dst.copy_(src), 20 if cuda else 5)
    del src, dst
    n = 8192 if cuda else 512
    mm_dtype = dtype if cuda else torch.float32
    a = torch.randn(n, n, device=device, dtype=mm_dtype)
    b = torch.randn(n, n, device=device, dtype=mm_dtype)
    t_mm = timer(lambda: a @ b, 10 if cuda else 3)
    del a, b
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    return Ceilings(device=name, copy_bytes_per_s=2 * n_bytes / t_copy, matmul_flops_per_s=2 * n**3 / t_mm,
                    fp8_matmul_flops_per_s=_fp8_matmul_rate(device, n, timer))


def _fp8_matmul_rate(device: torch.device, n: int, timer) -> float | None:
    """FLOP/s of an n x n x n FP8 product with row-wise scales and bf16 output (models/quant.py's
    scaled_mm); None where that product does not run."""
    from batchinfer.models.quant import FP8_DTYPE, scaled_mm_supported

    if not scaled_mm_supported(device):
        return None
    a = torch.randn(n, n, device=device).to(FP8_DTYPE)
    b = torch.randn(n, n, device=device).to(FP8_DTYPE)  # row-major [N, K]; .t() is column-major
    sa = torch.ones(n, 1, device=device)
    sb = torch.ones(1, n, device=device)
    t = timer(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=True), 10)
    return 2 * n**3 / t


def workload_floor(
    prompt_lens: list[int],
    output_lens: list[int],
    *,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int,
    layer_params: int,
    weight_bytes: int,
    dtype_bytes: int,
    kv_capacity_tokens: int,
    ceilings: Ceilings,
    layer_flops_per_s: float | None = None,
) -> Floor:
    """The floor of generating output_lens[i] tokens after prompt_lens[i] tokens for every request.

    layer_flops_per_s: the matrix rate of the decoder layers' projections (FP8's with FP8 weights);
    default the ceilings' 16-bit matmul rate, which the LM head and attention always get."""
    n = len(prompt_lens)
    total_prompt = sum(prompt_lens)
    total_out = sum(output_lens)
    attn_per_ctx = 4 * num_layers * num_heads * head_dim
    prefill_ctx = sum(p * (p + 1) // 2 for p in prompt_lens)
    decode_ctx = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    layer_flops = 2 * layer_params * (total_prompt + total_out)
    other_flops = 2 * vocab_size * hidden_size * (n + total_out) + attn_per_ctx * (prefill_ctx + decode_ctx)
    flops = layer_flops + other_flops

    mean_len = (total_prompt + total_out) / n
    concurrency = max(1, min(n, int(kv_capacity_tokens // max(mean_len, 1))))
    min_steps = max(max(output_lens), -(-total_out // concurrency))
    kv_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype_bytes)
    bytes_ = min_steps * weight_bytes
    bytes_ += decode_ctx * kv_per_token
    bytes_ += (total_prompt + total_out) * kv_per_token
    compute_s = layer_flops / (layer_flops_per_s or ceilings.matmul_flops_per_s) + other_flops / ceilings.matmul_flops_per_s
    memory_s = bytes_ / ceilings.copy_bytes_per_s
    return Floor(
        flops=float(flops),
        bytes=float(bytes_),
        compute_s=compute_s,
        memory_s=memory_s,
        floor_s=max(compute_s, memory_s),
        bound="memory" if memory_s >= compute_s else "compute",
        concurrency=concurrency,
        min_steps=min_steps,
    )
