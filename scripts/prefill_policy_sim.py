"""Predict a workload's run time under each prefill policy from the step cost model alone (no GPU).

Runs the real scheduler (engine/scheduler.py, with engine/prefill_policy.py) over a bench workload
(bench/workloads.py; outputs of exactly max_tokens, as with ignore_eos), the way the engine drives it
(at most 2 x max_num_seqs waiting), and sums engine/step_cost.py's time of every step at the CUDA
graph size it would replay (decode ladder for decode-only steps, mixed ladder for the others). The
numbers are the model's, not the GPU's: they say what each policy changes in the schedule (steps,
decode rows per step, prefill held back) and what that is worth if the model is right; the bench on
the GPU says whether it is.

Usage: python3 scripts/prefill_policy_sim.py --model llama-3.1-8b --workload nano256 [--kv-gib 100]
       [--max-num-seqs 256] [--set slack_tolerance=0.05 ...] [--device "NVIDIA H200"]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from batchinfer.bench.roofline import workload_floor
from batchinfer.bench.shapes import SHAPES
from batchinfer.bench.workloads import make_workload
from batchinfer.engine.cuda_graphs import graph_batch_sizes, ladder_size, mixed_graph_sizes
from batchinfer.engine.kv_cache import BlockAllocator
from batchinfer.engine.prefill_policy import make_prefill_policy
from batchinfer.engine.scheduler import Scheduler, SchedulerConfig
from batchinfer.engine.sequence import Sequence
from batchinfer.engine.step_cost import StepCost, device_ceilings
from batchinfer.models.loader import load_model_info


def simulate(info, workload: str, policy_name: str, *, max_num_seqs: int, budget: int, block_size: int,
             kv_gib: float, device: str, scale: float, slack: dict) -> dict:
    ceilings = device_ceilings("cuda", device)
    cost = StepCost.for_model(info, ceilings, 2)
    mixed = mixed_graph_sizes(budget)
    decode_sizes = graph_batch_sizes(max_num_seqs)
    policy = make_prefill_policy(policy_name, cost, graph_sizes=mixed, **slack)
    num_blocks = int(kv_gib * (1 << 30) // (block_size * cost.kv_bytes_per_token))
    max_len = info.max_position_embeddings
    sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_len), BlockAllocator(num_blocks, block_size), policy)
    wl = make_workload(workload, info.vocab_size, scale=scale)
    pending = [Sequence.from_request(i, r) for i, r in enumerate(wl.requests)]
    pending.reverse()
    total = 0.0
    steps = limited = decode_steps = decode_rows = 0
    while pending or sched.has_work():
        while pending and len(sched.waiting) < 2 * max_num_seqs:
            sched.add(pending.pop())
        step = sched.schedule()
        steps += 1
        limited += step.prefill_limited
        d = ctx = 0
        chunks = []
        for seq, n in zip(step.seqs, step.num_tokens):
            if seq.num_computed_tokens >= seq.num_prompt_tokens and n == 1:
                d += 1
                ctx += seq.num_computed_tokens + 1
            else:
                chunks.append((n, seq.num_computed_tokens))
        tokens = step.total_tokens
        if tokens:
            padded = ladder_size(mixed, tokens) if chunks and tokens <= mixed[-1] else (
                ladder_size(decode_sizes, tokens) if not chunks and tokens <= decode_sizes[-1] else tokens)
            total += cost.step_seconds(d, ctx, chunks, padded, sampled=sum(step.samples))
        if not chunks and d:
            decode_steps += 1
            decode_rows += d
        sched.complete_step(step)
        for seq, sampled in zip(step.seqs, step.samples):
            if sampled:
                seq.token_ids.append(1)
                if seq.num_generated >= seq.max_tokens:
                    sched.finish(seq)
    floor = workload_floor(
        wl.prompt_lens, wl.output_lens, num_layers=info.num_layers, hidden_size=info.hidden_size,
        num_heads=info.num_heads, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
        vocab_size=info.vocab_size, layer_params=info.num_layer_params, weight_bytes=info.weight_bytes,
        dtype_bytes=2, kv_capacity_tokens=num_blocks * block_size, ceilings=ceilings,
    )
    return {
        "policy": policy_name, "predicted_s": total, "steps": steps, "limited_steps": limited,
        "decode_only_steps": decode_steps, "mean_decode_rows": decode_rows / max(1, decode_steps),
        "preemptions": sched.num_preemptions, "floor_s": floor.floor_s, "fraction_of_floor": floor.floor_s / total,
        "output_tokens_per_s": sum(wl.output_lens) / total,
    }


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--workload", default="nano256")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-gib", type=float, default=100.0, help="KV cache size (an H200 gives an 8B model about 100)")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--device", default="NVIDIA H200", help="whose datasheet ceilings (bench/devices.py)")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--set", action="append", default=[], help="slack options: tolerance=, max_wait_steps=, max_idle_slots=")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    slack = {"tolerance": 0.05, "max_wait_steps": 32, "max_idle_slots": max(1, a.max_num_seqs // 32)}
    for kv in a.set:
        k, _, v = kv.partition("=")
        slack[k] = type(slack[k])(float(v)) if k in slack else sys.exit(f"unknown --set {k}")
    folder = Path(tempfile.mkdtemp()) / a.model
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SHAPES[a.model]))
    info = load_model_info(str(folder), "bfloat16", "cpu", a.quantization)
    out = []
    for name in ("budget", "slack"):
        r = simulate(info, a.workload, name, max_num_seqs=a.max_num_seqs, budget=a.max_num_batched_tokens,
                     block_size=a.block_size, kv_gib=a.kv_gib, device=a.device, scale=a.scale, slack=slack)
        out.append(r)
        print(f"{a.workload} {a.model} {name:>6}: predicted {r['predicted_s']:7.2f} s ({100 * r['fraction_of_floor']:.1f}% of the "
              f"floor {r['floor_s']:.2f} s), {r['steps']} steps ({r['limited_steps']} held prefill back), "
              f"decode-only steps {r['decode_only_steps']} at {r['mean_decode_rows']:.1f} rows, {r['preemptions']} preemptions")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main(sys.argv[1:])
