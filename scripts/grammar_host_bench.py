"""Host time per step of grammar-constrained decoding, measured on the CPU.

Why: on a GPU the grammar work (mask fill, token accept, EOS mirroring) runs on the host while the
device computes the next forward; whatever does not fit behind that forward is idle GPU time. A
model with the real Qwen 151k vocabulary and a tiny body (1 layer, hidden 64) makes the device part
of each CPU step small and keeps the grammar part exactly as large as on the GPU, so
StepStats.host_ms over decode-only steps measures the host work that matters there.

Run: `python3 scripts/grammar_host_bench.py [--backend llguidance xgrammar] [--requests 320] [--speculative grammar]
[--scale 0.5] [--json out.json] [--share-masks]`. The workload is docs1000-json (make_workload, fixed seed), cut to
`--requests` requests; with the default scale 0.5 outputs are up to 100 tokens and 256 run at once.
The output tokens of each backend are printed as a fingerprint (sha256 of all results) so runs
before and after a change can be checked to produce the same answers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

TINY_BODY = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32)


@dataclass(frozen=True)
class BenchConfig:
    """What one run measures: backends, workload size, where the model folder is kept."""

    backends: tuple[str, ...] = ("llguidance", "xgrammar")
    requests: int = 320
    scale: float = 0.5
    max_num_seqs: int = 256
    model_dir: Path = Path(tempfile.gettempdir()) / "batchinfer-grammar-host-bench"
    share_masks: bool = False  # EngineConfig.grammar_share_masks
    speculative: str | None = None  # EngineConfig.speculative method (grammar: forced drafts), None: off


def tiny_qwen_folder(out: Path) -> Path:
    """The qwen3-0.6b shape folder (real Qwen tokenizer) with its body shrunk to TINY_BODY."""
    from batchinfer.bench.shapes import write_shape

    write_shape("qwen3-0.6b", out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(TINY_BODY)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def run_one(cfg: BenchConfig, backend: str) -> dict:
    """One full run of the workload with one grammar backend; the numbers as a dict."""
    from batchinfer.bench.workloads import make_workload
    from batchinfer.engine import Engine, EngineConfig

    steps = []
    fill_ms: list[float] = []  # per step: the ms the library fills ran (on the CPU they overlap the forward)
    box: dict = {}

    def on_step(stats) -> None:
        steps.append(stats)
        grammar = box["engine"].grammar
        fill_ms.append(grammar.fill_s * 1000.0 - sum(fill_ms))

    engine = Engine(
        EngineConfig(model=str(tiny_qwen_folder(cfg.model_dir)), load_format="random", dtype="float32", device="cpu",
                     max_num_seqs=cfg.max_num_seqs, kv_cache_gib=2.0, grammar_backend=backend,
                     grammar_share_masks=cfg.share_masks,
                     speculative={"method": cfg.speculative, "num_tokens": 4} if cfg.speculative else None),
        on_step=on_step,
    )
    box["engine"] = engine
    wl = make_workload("docs1000-json", engine.model_info.vocab_size, scale=cfg.scale)
    requests = wl.requests[: cfg.requests]
    list(engine.generate(wl.requests[-2:]))  # compile the grammar and warm the thread pools
    steps.clear()
    fill_ms.clear()
    engine.grammar.fill_s = 0.0
    computed0, copied0, cached0 = engine.grammar.rows_computed, engine.grammar.rows_copied, engine.grammar.rows_cached
    t0 = time.perf_counter()
    results = sorted(engine.generate(requests), key=lambda r: r.request_id)
    wall = time.perf_counter() - t0
    decode = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    full = [s for s in decode if s.num_decode_tokens >= cfg.max_num_seqs]
    full_fill = [ms for s, ms in zip(steps, fill_ms) if s in full]
    digest = hashlib.sha256()
    for r in results:
        digest.update(f"{r.request_id}:{r.finish_reason}:{r.output_token_ids}\n".encode())
    return {
        "backend": backend,
        "requests": len(results),
        "errors": sum(r.finish_reason == "error" for r in results),
        "output_tokens": sum(r.completion_tokens for r in results),
        "wall_s": wall,
        "steps": len(steps),
        "decode_steps": len(decode),
        "decode_host_ms_mean": statistics.fmean(s.host_ms for s in decode) if decode else None,
        "full_decode_steps": len(full),
        "full_decode_host_ms_mean": statistics.fmean(s.host_ms for s in full) if full else None,
        "decode_wait_ms_mean": statistics.fmean(s.wait_ms for s in decode) if decode else None,
        # the library fill's own time per full decode step: on a GPU host this is what the step
        # waits for once it exceeds the forward (here it hides under the CPU forward, so host_ms omits it)
        "full_decode_fill_ms_mean": statistics.fmean(full_fill) if full_fill else None,
        # host ms by phase (StepStats.phases_ms) averaged over the full decode steps
        "full_decode_phases_ms": {k: round(statistics.fmean(s.phases_ms.get(k, 0.0) for s in full), 3)
                                  for k in sorted({k for s in full for k in s.phases_ms})} if full else None,
        "mask_rows_computed": engine.grammar.rows_computed - computed0,
        "mask_rows_copied": engine.grammar.rows_copied - copied0,
        "mask_rows_cached": engine.grammar.rows_cached - cached0,
        "outputs_sha256": digest.hexdigest()[:16],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", nargs="+", default=list(BenchConfig.backends))
    ap.add_argument("--requests", type=int, default=BenchConfig.requests)
    ap.add_argument("--scale", type=float, default=BenchConfig.scale)
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers to this file")
    ap.add_argument("--share-masks", action="store_true", help="one mask per grammar state (grammar_share_masks=True)")
    ap.add_argument("--speculative", default=None, help="speculative method (e.g. grammar: verify steps with forced drafts)")
    args = ap.parse_args()
    cfg = BenchConfig(backends=tuple(args.backend), requests=args.requests, scale=args.scale,
                      share_masks=args.share_masks, speculative=args.speculative)
    rows = []
    for backend in cfg.backends:
        row = run_one(cfg, backend)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
