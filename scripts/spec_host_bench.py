"""Host time per speculative verify step, measured on the CPU.

Why: a verify step (engine/speculative.py Speculator.step) runs serially, so on a GPU every ms of
host work in it (drafts, scheduling, packing, bans/masks, accepting and appending the tokens) is
device idle time. A demo model with a tiny body makes the device part of each CPU step small, while
the host part stays as large as on the GPU for the same batch (it depends on the number of rows and
drafts, not on the model size).

Run: `python3 scripts/spec_host_bench.py [--requests 256] [--scale 0.25] [--corrupt 0.3]
[--repeats 3] [--lanes] [--json out.json]`. The workload is nano256 (make_workload, fixed seed: 256 requests,
temperature 0.6, ignore_eos) with lengths shrunk by `--scale`; it runs plain once to record each
request's output, then with oracle drafts (bench/oracle.py, `--spec-tokens` per step, a share
`--corrupt` corrupted) `--repeats` times. Reported per run: the mean host ms per phase over the
decode-only verify steps with at least `--min-rows` rows (StepStats.phases_ms; `read_tokens` and
`launch` are mostly the forward and sampling, the device's part on the CPU; `sampling_batch`, the
host part of the sampling inside read_tokens, is timed apart and counted as host), and a fingerprint
(sha256) of all outputs, which must equal the plain run's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

TINY_BODY = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32)
# the forward and the sampling run synchronously on the CPU (sample_launch: the sampling, launched
# on a GPU; read_tokens: waiting for the step's tokens)
DEVICE_PHASES = ("launch", "sample_launch", "read_tokens")


def model_folder(out: Path) -> Path:
    """The demo qwen3 model with TINY_BODY (built once, kept in `out`)."""
    from batchinfer.demo import build_model

    if not (out / "config.json").is_file():
        build_model(out, "qwen3", **TINY_BODY)
    return out


class Timed:
    """A callable that times every call of `fn` (total_ms)."""

    def __init__(self, fn) -> None:
        self.fn, self.total_ms = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.total_ms += (time.perf_counter() - t) * 1000.0


def fingerprint(results) -> str:
    digest = hashlib.sha256()
    for r in sorted(results, key=lambda r: r.request_id):
        digest.update(f"{r.request_id}:{r.finish_reason}:{r.output_token_ids}\n".encode())
    return digest.hexdigest()[:16]


def engine_config(folder: Path, speculative=None):
    from batchinfer.engine import EngineConfig

    return EngineConfig(model=str(folder), dtype="float32", device="cpu", max_num_seqs=256, kv_cache_gib=1.0, torch_threads=1,
                        speculative=speculative)


def run_spec(folder: Path, requests, truth, args) -> dict:
    from batchinfer.bench.oracle import oracle_drafter
    from batchinfer.engine import Engine

    steps = []
    spec = {"method": "ngram+grammar", "num_tokens": args.spec_tokens, "lanes": args.lanes}
    batch_ms: list[float] = []  # per step: host ms building the sampler's inputs (inside read_tokens)

    def on_step(stats) -> None:
        steps.append(stats)
        batch_ms.append(timer.total_ms - sum(batch_ms))

    with Engine(engine_config(folder, spec), on_step=on_step,
                drafter=oracle_drafter(truth, args.corrupt, args.vocab, seed=0)) as engine:
        timer = Timed(engine.runner.sampling_batch)
        engine.runner.sampling_batch = timer
        t0 = time.perf_counter()
        results = list(engine.generate(requests))
        wall = time.perf_counter() - t0
    picked = [i for i, s in enumerate(steps)
              if s.num_prefill_tokens == 0 and s.spec_rows and s.spec_decode_rows >= args.min_rows]
    verify = [steps[i] for i in picked]
    names = sorted({k for s in verify for k in s.phases_ms})
    phases = {k: statistics.fmean(s.phases_ms.get(k, 0.0) for s in verify) for k in names} if verify else {}
    if verify:
        phases["sampling_batch"] = statistics.fmean(batch_ms[i] for i in picked)
    host = sum(v for k, v in phases.items() if k not in DEVICE_PHASES)
    return {
        "wall_s": wall,
        "steps": len(steps),
        "verify_steps": len(verify),
        "mean_rows": statistics.fmean(s.spec_decode_rows for s in verify) if verify else None,
        "acceptance": sum(s.spec_accepted for s in steps) / max(1, sum(s.spec_verified for s in steps)),
        "host_ms_no_device": host,
        "phases_ms": phases,
        "outputs_sha256": fingerprint(results),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--corrupt", type=float, default=0.3)
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--lanes", action="store_true",
                    help="verify steps in two lanes (engine/lanes.py; the CPU default is serial): host ms per lane step")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-rows", type=int, default=128, help="verify steps with at least this many rows")
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "batchinfer-spec-host-bench")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    args = ap.parse_args()

    from batchinfer.bench.workloads import make_workload
    from batchinfer.engine import Engine

    folder = model_folder(args.model_dir)
    with Engine(engine_config(folder)) as plain:
        args.vocab = plain.model_info.vocab_size
        requests = make_workload("nano256", args.vocab, scale=args.scale, count_scale=1.0).requests[: args.requests]
        results = list(plain.generate(requests))
    truth = {r.request_id: r.output_token_ids for r in results}
    rows = [{"run": "plain", "outputs_sha256": fingerprint(results)}]
    print(json.dumps(rows[0]), flush=True)
    for i in range(args.repeats):
        row = {"run": f"oracle-{i}", **run_spec(folder, requests, truth, args)}
        row["identical"] = row["outputs_sha256"] == rows[0]["outputs_sha256"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
