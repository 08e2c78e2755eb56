"""Can a mixed step's decode rows overlap its prefill chunk on two CUDA streams? (issue 17)

A mixed step of docs1000 on qwen3-0.6b (~250 decode rows over ~1,850-token contexts beside ~7,800
prefill tokens) runs its decode rows' KV stream (memory-bound) and its prefill GEMMs (compute-bound)
one kernel after another; the step cost model puts it at ~33 ms against a 17 ms floor that assumes
the two overlap. This probe builds that step on a real engine (random weights of a bench shape),
then times on the device, over `--reps` launches each:

  combined   the step as the engine runs it: one packed batch
  serial     its decode rows (a decode batch) then its prefill chunk (a prefill batch), one stream
  streams    the same two batches on two streams, joined
  decode     the decode batch alone;  prefill: the prefill batch alone

If `streams` is well under `combined`, splitting mixed steps pays; if it is near `serial`, the two
kinds of kernel do not share the GPU and the floor's overlap needs something else.

    python3 scripts/split_step_probe.py --model qwen3-0.6b --decode-rows 256 --context 1700 --prefill-tokens 7680
"""

from __future__ import annotations

import argparse
import random
from dataclasses import replace

import torch

from batchinfer.bench.throughput import bench_engine_config
from batchinfer.engine.engine import Engine
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.engine.sequence import Sequence


def _requests(prefix: str, n: int, length: int, vocab: int, rng: random.Random) -> list[Request]:
    return [Request(f"{prefix}{i}", [rng.randrange(10, vocab) for _ in range(length)],
                    SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)) for i in range(n)]


def _timed(fn, reps: int) -> float:
    """Mean device milliseconds of fn() over reps launches (after two untimed)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--decode-rows", type=int, default=256)
    ap.add_argument("--context", type=int, default=1700)
    ap.add_argument("--prefill-tokens", type=int, default=7680)
    ap.add_argument("--prompt", type=int, default=1920, help="length of each prefilling prompt")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--check", action="store_true", help="only check that the split step's logits are the combined "
                    "step's (runs on the CPU too)")
    args = ap.parse_args()
    if not torch.cuda.is_available() and not args.check:
        raise SystemExit("a CUDA device is needed (or --check)")
    rng = random.Random(0)
    budget = args.decode_rows + args.prefill_tokens
    cfg = replace(bench_engine_config(args.model), max_num_seqs=args.decode_rows + 64, max_num_batched_tokens=budget)
    with Engine(cfg) as engine:
        sched, runner, vocab = engine.scheduler, engine.runner, min(engine.model_info.vocab_size, 100_000)

        def add(reqs):
            for r in reqs:
                seq = Sequence.from_request(engine._next_id, r, seed=0, arrived=0.0)
                engine._next_id += 1
                sched.add(seq)

        def run_step():
            step = sched.schedule()
            batch = runner.prepare(step.seqs, step.num_tokens, step.samples)
            runner.forward(batch)
            sched.complete_step(step)
            for seq, flag in zip(step.seqs, step.samples):
                if flag:
                    seq.token_ids.append(rng.randrange(10, vocab))
            return step

        add(_requests("d", args.decode_rows, args.context, vocab, rng))
        while sched.waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in sched.running):
            run_step()
        n_prompts = -(-args.prefill_tokens // args.prompt)
        add(_requests("p", n_prompts, args.prompt, vocab, rng))
        step = sched.schedule()
        decode = [i for i, s in enumerate(step.seqs) if s.num_computed_tokens >= s.num_prompt_tokens]
        prefill = [i for i in range(len(step.seqs)) if i not in set(decode)]

        def part(idx):
            return runner.prepare([step.seqs[i] for i in idx], [step.num_tokens[i] for i in idx],
                                  [step.samples[i] for i in idx])

        whole, d, p = runner.prepare(step.seqs, step.num_tokens, step.samples), part(decode), part(prefill)
        kv = sum(s.num_computed_tokens for s in (step.seqs[i] for i in decode))
        print(f"{args.model}: a mixed step of {len(decode)} decode rows ({kv:,} KV tokens) and "
              f"{sum(step.num_tokens[i] for i in prefill):,} prefill tokens of {len(prefill)} prompts; graphs: "
              f"combined {runner.uses_graph(whole)}, decode {runner.uses_graph(d)}, prefill {runner.uses_graph(p)}")
        order = decode + prefill  # the split batches' sampling rows, in the combined step's terms
        rows = [sum(step.samples[:i]) for i in order if step.samples[i]]
        got = torch.cat([runner.forward(d).float().clone(), runner.forward(p).float().clone()])
        want = runner.forward(whole).float()[rows]
        print(f"  split logits against combined: max abs difference {(got - want).abs().max().item():.3g} "
              f"(logit scale {want.abs().max().item():.3g})")
        if args.check:
            return
        side = torch.cuda.Stream()
        main_stream = torch.cuda.current_stream()

        def streams():
            side.wait_stream(main_stream)
            with torch.cuda.stream(side):
                runner.forward(d)
            runner.forward(p)
            main_stream.wait_stream(side)

        times = {
            "combined": _timed(lambda: runner.forward(whole), args.reps),
            "serial": _timed(lambda: (runner.forward(d), runner.forward(p)), args.reps),
            "streams": _timed(streams, args.reps),
            "decode": _timed(lambda: runner.forward(d), args.reps),
            "prefill": _timed(lambda: runner.forward(p), args.reps),
        }
        for name, ms in times.items():
            print(f"  {name:>9}: {ms:7.2f} ms ({ms / times['combined']:.2f}x combined)")


if __name__ == "__main__":
    main()
