"""GPU profile of one mixed step (decode rows + prefill chunks), the step docs1000 spends half its time in.

Builds the model runner for a shape (random weights), packs one step like docs1000's steady state
(DECODE one-token rows with contexts uniform in [600, 2400], then prefill chunks of the given
lengths after a 200-token cached prefix) and measures:
1. host time to pack the step, host time to launch the eager forward, and the wall time to its end;
2. the same forward captured in one CUDA graph: the device time with no launch gaps;
3. device time per kernel (torch profiler over 3 eager forwards) and the host time per op;
4. host cost of one launch: a Triton kernel (rms_norm) vs a torch op, on a tiny tensor.
The extend kernel alone, over released shapes and launch configs: scripts/extend_shape_sweep.py.

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

from batchinfer.bench.gpu_timing import graph_ms
from batchinfer.bench.throughput import _model_folder
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.model_runner import ModelRunner


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
    replay_ms = graph_ms(lambda: runner.forward(batch), reps=5)
    print(f"graph replay of the same forward: {replay_ms:.2f} ms (device time without launch gaps)")

    # 2b. the engine's mixed-step graphs (every padded size captured), staged and replayed
    from batchinfer.engine.cuda_graphs import MixedGraphs

    t0 = time.perf_counter()
    buffers = runner.attention.graph_buffers(8192, len(lens), runner.max_blocks_per_seq, False, runner.device)
    mixed = MixedGraphs(buffers, 8192, len(lens), runner.vocab_size, runner.info.dtype, runner.device)
    mixed.capture(runner._logits_at, all_sizes=True)
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
    # the extend kernel alone over released shapes and launch configs: scripts/extend_shape_sweep.py

if __name__ == "__main__":
    main()
