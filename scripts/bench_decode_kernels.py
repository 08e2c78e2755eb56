"""GPU micro-benchmark of the decode step's two big parts, to tune them against their floors.

1. Paged decode attention (batchinfer.kernels.decode_attention) over a sweep of launch configs
   (context splits, keys per iteration, warps, pipeline stages) at several batch sizes, contexts
   uniform in [100, 2048] tokens (nano256's mid-run state), 16-token blocks in shuffled order.
   Effective bandwidth = KV bytes read / time; each config is timed as 20 launches in one CUDA graph.
2. The decode GEMMs of qwen3-0.6b and llama-3.1-8b at small M: time, TFLOP/s, weight GB/s, and the
   fraction of the GEMM's own floor (max of FLOPs / matrix rate, weight bytes / copy bandwidth).

Usage (device tool): python3 scripts/bench_decode_kernels.py [--quick]
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from batchinfer.bench.roofline import measure_ceilings
from batchinfer.kernels.decode_attention import paged_decode_attention


def graph_time(fn, reps: int = 20) -> float:
    """Seconds per call of fn, replaying a CUDA graph of `reps` calls (no launch overhead)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


def attention_sweep(quick: bool) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    block, d, hkv = 16, 128, 8
    max_b, max_ctx = 256, 2048
    num_blocks = max_b * max_ctx // block
    k_cache = torch.randn(num_blocks, block, hkv, d, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    tables = perm.view(max_b, max_ctx // block).to(dev)
    lens_all = torch.randint(100, max_ctx + 1, (max_b,), generator=gen, dtype=torch.int32)
    configs = [(bn, w, st) for bn in (32, 64, 128) for (w, st) in ((4, 2), (4, 3), (8, 2), (8, 3), (2, 2), (4, 4))]
    if quick:
        configs = [(64, 4, 2), (128, 4, 2), (64, 8, 3)]
    batches = (256, 128, 64, 32, 8, 1)
    for hq in (16, 32):
        print(f"\n== decode attention, {hq} query heads / {hkv} KV heads, d {d}, bf16 ==")
        print(f"{'B':>4} {'ctx':>6} {'old (8 splits, 64, 4w2s)':>26} {'launcher default':>22} {'best':>44}")
        for b in batches:
            lens = lens_all[:b].to(dev)
            q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            kv_bytes = int(lens.sum()) * hkv * d * 2 * 2
            results = {}
            for (bn, w, st), sp in itertools.product(configs, (1, 2, 4, 8, 16)):
                try:
                    t = graph_time(lambda: paged_decode_attention(
                        q, k_cache, v_cache, tables[:b], lens, 0.088, num_splits=sp, block_n=bn, out=out,
                        num_warps=w, num_stages=st))
                except Exception as e:  # out of shared memory etc.
                    print(f"   config {sp} splits {bn}/{w}w{st}s failed: {type(e).__name__}")
                    continue
                results[(sp, bn, w, st)] = t
            best = min(results, key=results.get)
            # the launcher's own choice (split count, keys per iteration, stages from its defaults)
            results["default"] = graph_time(lambda: paged_decode_attention(
                q, k_cache, v_cache, tables[:b], lens, 0.088, out=out))

            def fmt(key):
                t = results.get(key)
                return f"{t * 1e6:7.1f} us {kv_bytes / t / 1e9:6.0f} GB/s" if t else "n/a"
            print(f"{b:4d} {int(lens.float().mean()):6d} {fmt((8, 64, 4, 2)):>26} {fmt('default'):>22} "
                  f"{fmt(best):>26} @ {best[0]}sp {best[1]}n {best[2]}w{best[3]}s")
            top = sorted((k for k in results if k != "default"), key=results.get)[:5]
            print("      top5: " + "; ".join(f"{k[0]}sp {k[1]}n {k[2]}w{k[3]}s {kv_bytes / results[k] / 1e9:.0f}" for k in top))


SHAPES = {
    "qwen3-0.6b": [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144), ("down", 3072, 1024),
                   ("lm_head", 1024, 151936)],
    "llama-3.1-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096),
                     ("lm_head", 4096, 128256)],
}


def gemm_sweep() -> None:
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    print(f"\n== decode GEMMs (bf16 F.linear); ceilings copy {ceil.copy_bytes_per_s / 1e9:.0f} GB/s, "
          f"matmul {ceil.matmul_flops_per_s / 1e12:.0f} TFLOP/s ==")
    for model, shapes in SHAPES.items():
        print(f"-- {model}")
        for m in (8, 32, 64, 128, 256, 512):
            parts, total_t, total_floor = [], 0.0, 0.0
            for name, k, n in shapes:
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                t = graph_time(lambda: F.linear(x, w))
                floor = max(2 * m * k * n / ceil.matmul_flops_per_s, 2 * k * n / ceil.copy_bytes_per_s)
                total_t += t
                total_floor += floor
                parts.append(f"{name} {t * 1e6:6.1f}us {100 * floor / t:3.0f}%")
            print(f"M={m:4d}: " + " | ".join(parts) + f" || all {total_t * 1e6:7.1f} us, {100 * total_floor / total_t:.0f}% of floor")


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    if "--gemm-only" not in sys.argv:
        attention_sweep(quick)
    gemm_sweep()
