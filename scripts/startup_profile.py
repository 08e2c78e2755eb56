"""Where an engine's start-up goes, on a GPU: build the engine of a bench shape twice in one process
(the first pays Triton compiles and library set-up, the second shows the steady cost) and print its
start-up phases, the Triton variants compiled during each build and, with --profile, the top of a
cProfile of the first build (--profile-build N: of build N; --stats-out FILE keeps it).

    python3 scripts/startup_profile.py --model qwen3-0.6b [--profile] [--set max_num_seqs=256]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from batchinfer.bench.profile_window import jit_compiled_since, jit_snapshot
from batchinfer.bench.throughput import _model_folder
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.engine import Engine


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--builds", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-build", type=int, default=0, help="which build --profile profiles (0: the first, which compiles)")
    ap.add_argument("--stats-out", default=None, help="also write the profile (pstats) to this file")
    ap.add_argument("--set", action="append", default=[], help="EngineConfig field=value")
    args = ap.parse_args()
    folder, load_format = _model_folder(args.model, Path(tempfile.gettempdir()) / "batchinfer-bench")
    cfg = EngineConfig(model=folder, dtype="bfloat16", load_format=load_format)
    cfg = replace(cfg, **{k: _value(v) for k, v in (s.split("=", 1) for s in args.set)})
    for build in range(args.builds):
        before = jit_snapshot()
        prof = cProfile.Profile() if args.profile and build == args.profile_build else None
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        engine = Engine(cfg)
        if prof is not None:
            prof.disable()
        total = time.perf_counter() - t
        spans = engine.runner.startup_spans
        parts = ", ".join(f"{name} {end - start:.2f}" for name, start, end in spans)
        print(f"build {build}: {total:.2f} s: {parts}; blocks {engine.runner.num_blocks}; compiled {jit_compiled_since(before)}")
        if prof is not None and args.stats_out:
            prof.dump_stats(args.stats_out)
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(45)
            print(s.getvalue()[:9000])
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            print(s.getvalue()[:6000])
        engine.close()
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
