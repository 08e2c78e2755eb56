"""Where speculation stops paying, by batch size (issue 15's per-batch-size table).

One process: the ceilings measured once; a plain engine records the workload's outputs (the oracle)
and is timed on the first N requests for each N in --batches; then an engine with oracle drafts (and,
with --gate, one more with engine.speculative.gate) is timed on the same requests. With N requests
and max_num_seqs >= N every step runs at most N sequences, so N is the batch. nano256's first N
requests are the same whatever the count (bench/workloads.py draws them in order), so one
recording serves every N.

    python3 scripts/spec_batch_sweep.py --model qwen3-0.6b --batches 1,4,16,64,128,256 --spec-tokens 6 \
        --oracle-corrupt 0.10 --gate --json sweep.json

Prints, per N and run: elapsed, output tok/s, decode-only tok/s, acceptance, tokens per sequence
per forward, and each speculative run's decode-only and end-to-end speed over the plain run's.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch

from batchinfer.bench.oracle import oracle_drafter
from batchinfer.bench.roofline import measure_ceilings
from batchinfer.bench.throughput import BenchEngine, bench_engine_config, load_workload, measure_workload

FULL = 256  # nano256's request count at count scale 1


def _row(report: dict) -> dict:
    spec = report.get("speculative") or {}
    dec = report.get("decode_only") or {}
    return {
        "elapsed_s": report["elapsed_s"],
        "output_tokens_per_s": report["output_tokens_per_s"],
        "decode_only_tokens_per_s": dec.get("output_tokens_per_s"),
        "acceptance": spec.get("acceptance"),
        "tokens_per_seq_per_forward": spec.get("tokens_per_seq_per_forward"),
        "gate": report.get("speculation_gate"),
    }


def _measure(bench: BenchEngine, args, ceilings, n: int, speculative: str | None) -> dict:
    return _row(measure_workload(bench, args.model, args.workload, ceilings, scale=args.scale, count_scale=n / FULL,
                                 speculative=speculative, oracle_corrupt=args.oracle_corrupt if speculative else 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--workload", default="nano256", choices=["nano256"])
    ap.add_argument("--batches", default="1,4,16,64,128,256")
    ap.add_argument("--spec-tokens", type=int, default=6)
    ap.add_argument("--oracle-corrupt", type=float, default=0.10)
    ap.add_argument("--gate", action="store_true", help="also time an engine with engine.speculative.gate")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink lengths (CPU smoke runs)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    batches = sorted({int(b) for b in args.batches.split(",")})
    if batches[0] < 1 or batches[-1] > FULL:
        ap.error(f"--batches must lie in [1, {FULL}]")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceilings = measure_ceilings(device)
    cfg = replace(bench_engine_config(args.model), max_num_seqs=batches[-1])
    out: dict = {"model": args.model, "workload": args.workload, "spec_tokens": args.spec_tokens,
                 "oracle_corrupt": args.oracle_corrupt, "device": ceilings.device, "rows": {}}
    spec_runs = {"oracle": False} | ({"oracle+gate": True} if args.gate else {})  # name: engine.speculative.gate

    bench = BenchEngine(replace(cfg, speculative=None))
    try:
        eng = bench.engine
        wl = load_workload(args.workload, eng.tokenizer, eng.model_info.vocab_size, eng.max_model_len, scale=args.scale,
                           count_scale=batches[-1] / FULL)
        truth = {r.request_id: r.output_token_ids for r in eng.generate(wl.requests)}
        vocab = eng.model_info.vocab_size
        for n in batches:
            out["rows"].setdefault(str(n), {})["plain"] = _measure(bench, args, ceilings, n, None)
    finally:
        bench.close()
    for name, gate in spec_runs.items():
        spec = {"method": "ngram+grammar", "num_tokens": args.spec_tokens, "gate": gate}
        bench = BenchEngine(replace(cfg, speculative=spec), oracle_drafter(truth, args.oracle_corrupt, vocab))
        try:
            for n in batches:
                out["rows"][str(n)][name] = _measure(bench, args, ceilings, n, "oracle")
        finally:
            bench.close()

    print(f"{args.model} {args.workload}, oracle drafts k{args.spec_tokens}, {args.oracle_corrupt:.0%} corrupted, {ceilings.device}")
    print("| batch | run | elapsed | output tok/s | decode-only tok/s | acceptance | tokens/seq/forward | end to end | decode-only |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for n, row in out["rows"].items():
        base = row["plain"]
        for name, r in row.items():
            e2e = dec_x = ""
            if name != "plain":
                e2e = f"{base['elapsed_s'] / r['elapsed_s']:.2f}x"
                if r["decode_only_tokens_per_s"] and base["decode_only_tokens_per_s"]:
                    dec_x = f"{r['decode_only_tokens_per_s'] / base['decode_only_tokens_per_s']:.2f}x"
            acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
            tpf = "-" if r["tokens_per_seq_per_forward"] is None else f"{r['tokens_per_seq_per_forward']:.2f}"
            dec = "-" if r["decode_only_tokens_per_s"] is None else f"{r['decode_only_tokens_per_s']:,.0f}"
            print(f"| {n} | {name} | {r['elapsed_s']:.2f} s | {r['output_tokens_per_s']:,.0f} | {dec} | {acc} | {tpf} | "
                  f"{e2e} | {dec_x} |")
            if r["gate"]:
                print(f"|  | gate steps {r['gate']['steps']} |  |  |  |  |  |  |  |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
