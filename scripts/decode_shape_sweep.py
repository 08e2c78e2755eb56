"""Decode attention launch sweep over the shape matrix (bench/shapes.py MATRIX): for each shape's
(query heads, KV heads, head_dim) and batch size, every launch config's effective KV bandwidth,
against the measured copy bandwidth. The data behind kernels/decode_attention.launch_config.

Contexts uniform in [100, 2048] tokens, 16-token blocks in shuffled order, bf16 (or --kv fp8).
Usage (device tool): python3 scripts/decode_shape_sweep.py [--json out.json] [--batches 256,64,16,1]
"""
from __future__ import annotations

import itertools
import json
import sys

import torch

from batchinfer.bench.roofline import measure_ceilings
from batchinfer.kernels.decode_attention import paged_decode_attention

sys.path.insert(0, "scripts")
from bench_decode_kernels import graph_time  # noqa: E402

# (name, query heads, KV heads, head_dim) of released models
MATRIX = [
    ("qwen2.5-7b", 28, 4, 128), ("qwen2.5-1.5b", 12, 2, 128), ("qwen2.5-0.5b", 14, 2, 64),
    ("smollm2-135m", 9, 3, 64), ("llama-3.2-3b", 24, 8, 128), ("qwen2.5-3b", 16, 2, 128),
    ("llama-3.2-1b", 32, 8, 64), ("llama-2-7b", 32, 32, 128), ("qwen1.5-0.5b", 16, 16, 64),
    ("qwen3-0.6b", 16, 8, 128), ("llama-3.1-8b", 32, 8, 128),
]


def main() -> None:
    args = sys.argv[1:]
    out_json = args[args.index("--json") + 1] if "--json" in args else None
    batches = [int(b) for b in (args[args.index("--batches") + 1] if "--batches" in args else "256,64,8").split(",")]
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    copy = ceil.copy_bytes_per_s
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    block, max_ctx = 16, 2048
    configs = [(32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3)]
    rows = []
    only = args[args.index("--shapes") + 1].split(",") if "--shapes" in args else None
    for name, hq, hkv, d in MATRIX:
        if only and name not in only:
            continue
        max_b = max(batches)
        num_blocks = max_b * max_ctx // block
        k_cache = torch.randn(num_blocks, block, hkv, d, device=dev, dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(max_b, max_ctx // block).to(dev)
        lens_all = torch.randint(100, max_ctx + 1, (max_b,), generator=gen, dtype=torch.int32)
        print(f"\n== {name}: {hq} q / {hkv} kv heads (group {hq // hkv}), d {d}")
        for b in batches:
            lens = lens_all[:b].to(dev)
            q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            kv_bytes = int(lens.sum()) * hkv * d * 2 * 2
            res = {}
            for (bn, w, st), sp in itertools.product(configs, (1, 2, 4, 8, 16)):
                try:
                    res[(sp, bn, w, st)] = graph_time(lambda: paged_decode_attention(
                        q, k_cache, v_cache, tables[:b], lens, 0.088, num_splits=sp, block_n=bn, out=out,
                        num_warps=w, num_stages=st), reps=10)
                except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
                    print(f"   {sp}sp {bn}n {w}w{st}s failed: {type(e).__name__}")
            default = graph_time(lambda: paged_decode_attention(q, k_cache, v_cache, tables[:b], lens, 0.088, out=out), reps=10)
            best = min(res, key=res.get)
            gbs = lambda t: kv_bytes / t / 1e9  # noqa: E731
            top = sorted(res, key=res.get)[:4]
            print(f"B={b:4d} default {gbs(default):5.0f} GB/s ({100 * gbs(default) * 1e9 / copy:3.0f}% of copy) | best "
                  f"{gbs(res[best]):5.0f} ({100 * gbs(res[best]) * 1e9 / copy:3.0f}%) @ {best} | top "
                  + "; ".join(f"{k} {gbs(res[k]):.0f}" for k in top))
            rows.append(dict(shape=name, hq=hq, hkv=hkv, d=d, batch=b, kv_bytes=kv_bytes, default_s=default,
                             results={"/".join(map(str, k)): t for k, t in res.items()}))
        if out_json:  # after every shape: a run cut short keeps what it measured
            with open(out_json, "w") as f:
                json.dump(dict(copy_bytes_per_s=copy, rows=rows), f)
        del k_cache, v_cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
