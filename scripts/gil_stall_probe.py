"""How long each part of the job's preflight stops the main thread: each part runs on a thread while the
main thread ticks every 1 ms; a tick that comes late was held up by a call that kept the GIL.

    python3 scripts/gil_stall_probe.py [--model qwen3-0.6b] [--backend llguidance]

Prints, per part (tokenizer load, grammar compiler set-up, the bench schema's compile): its time, the
longest stall of the main thread and the stalls over 20 ms added up (BENCHMARKS.md, ninth session).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable


def ticked(name: str, fn: Callable[[], Any]) -> Any:
    """Run fn on a thread while this thread sleeps 1 ms at a time; print how late the ticks came."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    stalls: list[float] = []
    last = start = time.perf_counter()
    thread.start()
    while thread.is_alive():
        time.sleep(0.001)
        now = time.perf_counter()
        stalls.append(now - last)
        last = now
    print(f"{name:10s} {last - start:5.2f} s; main thread: longest stall {max(stalls) * 1000:4.0f} ms, "
          f"stalls over 20 ms {sum(s for s in stalls if s > 0.02):.2f} s", flush=True)
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b", help="a bench shape (its folder carries the tokenizer)")
    ap.add_argument("--backend", default="auto", help="structured.backend")
    args = ap.parse_args()
    from batchinfer.bench.shapes import write_shape
    from batchinfer.bench.workloads import DOCS_SCHEMA
    from batchinfer.models.loader import load_model_info, load_tokenizer
    from batchinfer.structured.base import Constraint
    from batchinfer.structured.compiler import GrammarCompiler

    folder = write_shape(args.model, Path(tempfile.gettempdir()) / "batchinfer-bench" / args.model)
    info = load_model_info(str(folder), "auto")
    tokenizer = ticked("tokenizer", lambda: load_tokenizer(folder))
    compiler = ticked("compiler", lambda: GrammarCompiler(tokenizer, info.vocab_size, args.backend, eos_ids=info.eos_token_ids))
    ticked("compile", lambda: compiler.compile(Constraint.json_schema(DOCS_SCHEMA)))


if __name__ == "__main__":
    main()
