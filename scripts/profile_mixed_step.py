"""GPU profile of one mixed step (decode rows + prefill chunks), the step docs1000 spends half its time in.

Builds the model runner for a shape (random weights), packs one step like docs1000's steady state
(DECODE one-token rows with contexts uniform in [600, 2400], then prefill chunks of the given
lengths after a 200-token cached prefix) and measures:
1. host time to pack the step, host time to launch the eager forward, and the wall time to its end;
2. the same forward captured in one CUDA graph: the device time with no launch gaps;
3. device time per kernel (torch profiler over 3 eager forwards) and the host time per op;
4. host cost of one launch: a Triton kernel (rms_norm) vs a torch op, on a tiny tensor;
5. the extend-attention kernel alone over the step's prefill chunks, for a sweep of launch configs.

Usage (device tool): python3 scripts/profile_mixed_step.py [--model qwen3-0.6b] [--decode 256]
    [--prefill 2600,2600,2600]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from batchinfer.bench.throughput import _model_folder
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.model_runner import ModelRunner


def graph_time(fn, reps: int = 5) -> float:
    """Milliseconds per call of fn replayed from a CUDA graph (no launch overhead)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _timed(fn) -> tuple[float, object]:
    """(host milliseconds, result) of one call of fn."""
    t0 = time.perf_counter()
    out = fn()
    return (time.perf_counter() - t0) * 1e3, out


def _host_and_wall(fn, reps: int = 10) -> tuple[float, float]:
    """Median host milliseconds of fn (launching only) and until the device has finished it."""
    fn()
    launch, wall = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        launch.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(launch), statistics.median(wall)


def build_step(runner: ModelRunner, num_decode: int, prefill: list[int], prefix: int = 200):
    rng = np.random.default_rng(0)
    bs = runner.block_size
    dec_ctx = rng.integers(600, 2400, num_decode).tolist()
    starts = [c - 1 for c in dec_ctx] + [prefix] * len(prefill)
    lens = [1] * num_decode + list(prefill)
    totals = [s + n for s, n in zip(starts, lens)]
    need = [-(-t // bs) for t in totals]
    perm = rng.permutation(sum(need)).tolist()
    tables, pos = [], 0
    for n in need:
        tables.append(perm[pos : pos + n])
        pos += n
    ids = [rng.integers(0, runner.vocab_size, n).tolist() for n in lens]
    samples = [True] * num_decode + [True] * len(prefill)
    return starts, lens, ids, tables, samples, sum(need)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--prefill", default="2600,2600,2600")
    args = ap.parse_args()
    prefill = [int(x) for x in args.prefill.split(",") if x]
    folder, fmt = _model_folder(args.model, Path(tempfile.gettempdir()) / "batchinfer-bench")
    probe = EngineConfig(model=folder, dtype="bfloat16", load_format=fmt, num_kv_blocks=1, cuda_graphs=False)
    runner = ModelRunner(probe)
    starts, lens, ids, tables, samples, blocks = build_step(runner, args.decode, prefill)
    runner.kv_caches = runner._allocate(blocks + 1)
    print(f"model {args.model}; step: {args.decode} decode rows + prefill chunks {prefill} = {sum(lens)} tokens, {blocks} KV blocks")

    # 1. pack, launch, wall
    med = statistics.median
    pack = [_timed(lambda: runner._pack(starts, lens, ids, tables, samples))[0] for _ in range(5)]
    batch = runner._pack(starts, lens, ids, tables, samples)
    launch, wall = _host_and_wall(lambda: runner.forward(batch))
    print(f"eager: pack {med(pack):.2f} ms, launch {launch:.2f} ms (host), launch..done {wall:.2f} ms")

    # 2. the same forward in one CUDA graph
    batch = runner._pack(starts, lens, ids, tables, samples)
    graph_ms = graph_time(lambda: runner.forward(batch))
    print(f"graph replay of the same forward: {graph_ms:.2f} ms (device time without launch gaps)")

    # 2b. the engine's mixed-step graphs (every padded size captured), staged and replayed
    from batchinfer.engine.cuda_graphs import MixedGraphs

    t0 = time.perf_counter()
    buffers = runner.attention.graph_buffers(8192, len(lens), runner.max_blocks_per_seq, False, runner.device)
    mixed = MixedGraphs(buffers, 8192, len(lens), runner.vocab_size, runner.info.dtype, runner.device)
    mixed.capture(runner._logits_at)
    print(f"captured {len(mixed.sizes)} mixed-step graphs in {time.perf_counter() - t0:.1f} s, "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
    eager_logits = runner.forward(batch).clone()
    launch, wall = _host_and_wall(lambda: mixed.run(batch.input_ids, batch.positions, batch.meta, batch.sample_index))
    logits = mixed.logits[: batch.sample_index.shape[0]]
    diff = ((logits.float() - eager_logits.float()).abs().max() / eager_logits.float().abs().max()).item()
    print(f"mixed graph: stage+replay {launch:.2f} ms (host), done after {wall:.2f} ms; "
          f"max rel. logit diff vs eager {diff:.2e}")

    # 3. device time per kernel and host time per op
    from torch.profiler import ProfilerActivity, profile

    reps = 3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            runner.forward(batch)
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            rec = per_kernel[ev.name[:70]]
            rec[0] += ev.device_time_total / 1e3 / reps if hasattr(ev, "device_time_total") else ev.cuda_time_total / 1e3 / reps
            rec[1] += 1 / reps
    total = sum(v[0] for v in per_kernel.values())
    print(f"device time per forward by kernel (sum {total:.2f} ms):")
    for name, (ms, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:18]:
        print(f"  {ms:8.3f} ms  {n:6.0f} launches  {name}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))

    # 4. launch cost
    from batchinfer.kernels import ops

    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(1024, device="cuda", dtype=torch.bfloat16)
    for fn, name in ((lambda: ops.rms_norm(x, w, 1e-6), "triton rms_norm"), (lambda: torch.add(x, x), "torch.add"),
                     (lambda: torch.nn.functional.linear(x, x), "F.linear")):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        print(f"host launch cost {name}: {(t1 - t0) / 2000 * 1e6:.1f} us")

    # 5. the extend kernel alone, over the prefill chunks
    from batchinfer.kernels.extend_attention import paged_extend_attention

    info = runner.info
    meta = batch.meta
    n_dec = meta.num_leading_single
    t = sum(lens)
    q = torch.randn(t, info.num_heads, info.head_dim, device="cuda", dtype=torch.bfloat16)
    k_cache, v_cache = runner.kv_caches[0]
    out = torch.empty_like(q)
    scale = info.head_dim**-0.5
    flops = sum(4 * n * (s + (n + 1) / 2) * info.num_heads * info.head_dim for s, n in zip(starts[n_dec:], lens[n_dec:]))
    print(f"extend attention over {len(prefill)} chunks ({flops / 1e9:.1f} GFLOP per layer):")
    for rows, bn, warps, stages in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3),
                                    (128, 32, 4, 2), (64, 128, 4, 2), (128, 128, 8, 2), (256, 64, 8, 2), (128, 64, 4, 3)]:
        try:
            ms = graph_time(lambda: paged_extend_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.max_query_len,
                scale, block_rows=rows, block_n=bn, out=out, first_seq=n_dec, num_warps=warps, num_stages=stages))
            print(f"  rows {rows:3d} keys {bn:3d} warps {warps} stages {stages}: {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s"
                  f"  x{info.num_layers} layers = {ms * info.num_layers:6.2f} ms")
        except Exception as exc:  # a config the GPU cannot run (shared memory)
            print(f"  rows {rows} keys {bn} warps {warps} stages {stages}: failed: {str(exc)[:100]}")


if __name__ == "__main__":
    main()
