"""Paged extend-attention launch sweep: kernels.extend_attention.paged_extend_attention alone (no model,
no engine) over released attention shapes, a few prefill / speculative-verify workloads and a grid of
launch configs (block_rows, block_n, num_warps, num_stages).

For each (shape, workload): random bf16 K/V caches (randn) in 16-token blocks (EngineConfig's default
block size) handed out in a random order, q randn [T, Hq, D], the kernel's tile map built on the host
(so the launch is CUDA-graph capturable), one check of the default config against
kernels.reference.paged_attention (max abs error; every other config's output is compared with the
default's, DIFF when it differs), then per config the median of 10 CUDA-graph replays:
milliseconds, TFLOP/s of the causal FLOPs (sum of 4 * q_len * (ctx_before + (q_len + 1) / 2) * Hq * D)
and GB/s of the KV bytes (sum of seq_len * Hkv * D * 2 tensors * element size). The best config of
each (shape, workload) is marked with its speedup over the default; a summary table comes last (the
device tool returns only the tail of the output); --out writes every result as JSON. The default
config 64/64/4/2 is always timed (the ratios' base). All (shape, config) kernels are compiled first on
--compile-jobs threads (one at a time they would take minutes).

Workloads: prefill = 3 chunks of 2600 new tokens after a 200-token cached prefix; chunks = 8 chunks of
512 after 1000 cached; verify = 256 sequences x 5 query tokens, contexts (whole seq_len) uniform in
[600, 2400]; verify64 = the same with 64 sequences.

Usage (device tool): python3 scripts/extend_shape_sweep.py [--shapes a,b] [--workloads prefill,verify]
    [--configs 64/64/4/2,...] [--out f.json]
CPU check of the script itself (Triton interpreter, tiny workloads, float32, no CUDA graphs):
    python3 scripts/extend_shape_sweep.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # batchinfer without PYTHONPATH

BLOCK_SIZE = 16  # batchinfer.engine.config.EngineConfig.block_size

# (name, query heads, KV heads, head_dim): GQA groups 1..8, head_dim 64 and 128
SHAPES: list[tuple[str, int, int, int]] = [
    ("qwen3-0.6b", 16, 8, 128),  # group 2
    ("llama-3.1-8b", 32, 8, 128),  # group 4
    ("qwen2.5-1.5b", 12, 2, 128),  # group 6
    ("qwen2.5-7b", 28, 4, 128),  # group 7
    ("qwen2.5-14b", 40, 8, 128),  # group 5
    ("qwen2.5-0.5b", 14, 2, 64),  # group 7, head_dim 64
    ("smollm2-135m", 9, 3, 64),  # group 3, head_dim 64
    ("group1", 32, 32, 128),  # MHA (llama-2-7b)
    ("group3", 24, 8, 128),  # (llama-3.2-3b)
    ("group8", 64, 8, 128),
]
WORKLOADS = ["prefill", "chunks", "verify", "verify64"]

Config = tuple[int, int, int, int]  # block_rows, block_n, num_warps, num_stages
DEFAULT_CONFIG: Config = (64, 64, 4, 2)
CONFIGS: list[Config] = [
    DEFAULT_CONFIG, (16, 64, 4, 2), (32, 64, 4, 2), (32, 32, 4, 2), (16, 32, 2, 2), (64, 32, 4, 2),
    (128, 64, 8, 2), (128, 64, 4, 2), (128, 128, 8, 2), (128, 64, 8, 3), (256, 64, 8, 2), (64, 128, 4, 2),
]
GPU_TOLERANCE = 5e-2  # max abs error flagged BAD on the GPU (bf16 output and bf16 probabilities)
SMOKE_TOLERANCE = 2e-2  # asserted in --cpu-smoke (float32)


@dataclass
class Workload:
    """Sequences of one step: ctx_before[b] cached tokens, then q_lens[b] new ones."""

    name: str
    ctx_before: list[int]
    q_lens: list[int]

    @property
    def seq_lens(self) -> list[int]:
        return [c + n for c, n in zip(self.ctx_before, self.q_lens)]


@dataclass
class Batch:
    """Device tensors of one kernel call."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    out: torch.Tensor
    scale: float


@dataclass
class Result:
    shape: str
    workload: str
    config: str
    ms: float | None
    tflops: float | None
    gbs: float | None
    diff: float | None = None  # max abs difference from the default config's output
    error: str | None = None


def config_name(config: Config) -> str:
    return "/".join(str(x) for x in config)


def parse_configs(text: str) -> list[Config]:
    """"rows/n/warps/stages,..." -> configs; the default config always comes first (the ratios' base)."""
    configs: list[Config] = []
    for item in text.split(","):
        parts = [int(x) for x in item.strip().split("/")]
        if len(parts) != 4:
            raise SystemExit(f"--configs: {item!r} is not rows/n/warps/stages")
        configs.append((parts[0], parts[1], parts[2], parts[3]))
    return [DEFAULT_CONFIG] + [c for c in configs if c != DEFAULT_CONFIG]


def make_workload(name: str, rng: np.random.Generator) -> Workload:
    if name == "prefill":
        return Workload(name, [200] * 3, [2600] * 3)
    if name == "chunks":
        return Workload(name, [1000] * 8, [512] * 8)
    if name in ("verify", "verify64"):
        num = 256 if name == "verify" else 64
        seq_lens = rng.integers(600, 2401, num).tolist()
        return Workload(name, [s - 5 for s in seq_lens], [5] * num)
    raise SystemExit(f"unknown workload {name!r} (known: {', '.join(WORKLOADS)})")


def smoke_workloads() -> list[Workload]:
    """Tiny workloads for the interpreter: contexts crossing block and key-tile boundaries."""
    return [
        Workload("prefill", [0, 21], [37, 50]),
        Workload("verify", [70, 33, 130], [5, 5, 5]),
    ]


def causal_flops(work: Workload, num_heads: int, head_dim: int) -> float:
    return sum(4 * n * (c + (n + 1) / 2) * num_heads * head_dim for c, n in zip(work.ctx_before, work.q_lens))


def kv_bytes(work: Workload, num_kv_heads: int, head_dim: int, element_size: int) -> int:
    return sum(s * num_kv_heads * head_dim * 2 * element_size for s in work.seq_lens)


def build_batch(
    work: Workload, num_heads: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: str, seed: int,
) -> Batch:
    """Random caches with every sequence's blocks at random places of the cache."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    need = [-(-s // BLOCK_SIZE) for s in work.seq_lens]
    num_blocks = sum(need) + 1
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(need), max(need)), dtype=np.int32)
    pos = 0
    for b, n in enumerate(need):
        tables[b, :n] = perm[pos : pos + n]
        pos += n
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device, dtype=dtype)
    num_tokens = sum(work.q_lens)
    q = torch.randn((num_tokens, num_heads, head_dim), generator=gen, device=device, dtype=dtype)
    qsl = np.concatenate([[0], np.cumsum(work.q_lens)]).astype(np.int32)
    return Batch(
        q=q, k_cache=k_cache, v_cache=v_cache,
        block_tables=torch.from_numpy(tables).to(device),
        seq_lens=torch.tensor(work.seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.from_numpy(qsl).to(device),
        max_query_len=max(work.q_lens), out=torch.empty_like(q), scale=head_dim**-0.5,
    )


def kernel_call(batch: Batch, work: Workload, config: Config) -> Callable[[], torch.Tensor]:
    """The launch of one config with its tile map prebuilt (nothing read back: graph capturable)."""
    from batchinfer.kernels.extend_attention import (
        extend_block_m,
        extend_tile_map,
        paged_extend_attention,
    )

    rows, block_n, warps, stages = config
    group = batch.q.shape[1] // batch.k_cache.shape[2]
    tile_map = extend_tile_map(work.q_lens, 0, extend_block_m(group, rows))
    tiles = torch.from_numpy(tile_map).to(batch.q.device)

    def call() -> torch.Tensor:
        return paged_extend_attention(
            batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
            batch.max_query_len, batch.scale, block_rows=rows, block_n=block_n, out=batch.out,
            num_warps=warps, num_stages=stages, tiles=tiles,
        )

    return call


def precompile(shapes: list[tuple[str, int, int, int]], configs: list[Config], dtype: torch.dtype, jobs: int) -> None:
    """Compile every (shape, config) on `jobs` threads before timing: one at a time ~120 compiles take
    minutes, and Triton's compiler releases the GIL. Each launch goes to the kernel's compile-only
    (warmup) path under triton.AsyncCompileMode; the sweep's calls then find the kernels compiled (the
    launch specialises on strides that depend on the shape alone). A config that does not compile is
    left to fail again, and be reported, in the sweep."""
    import triton

    from batchinfer.kernels import extend_attention

    kernel = extend_attention._extend_kernel
    launch = kernel.run

    def compile_only(*args: object, **kwargs: object) -> object:
        kwargs["warmup"] = True
        return launch(*args, **kwargs)

    tiny = Workload("warm", [20, 5], [17, 9])  # block-table width 3, >= 2 tiles: nothing specialised on 1
    t0 = time.perf_counter()
    kernel.run = compile_only
    try:
        with ThreadPoolExecutor(jobs) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
            for shape in shapes:
                batch = build_batch(tiny, shape[1], shape[2], shape[3], dtype, "cuda", seed=0)
                for config in configs:
                    kernel_call(batch, tiny, config)()
    except Exception as exc:  # noqa: BLE001 (a Triton without this path: the sweep compiles one at a time)
        print(f"precompile skipped: {type(exc).__name__}: {str(exc)[:100]}")
    finally:
        del kernel.run
    print(f"compiled {len(shapes)} shapes x {len(configs)} configs on {jobs} threads in {time.perf_counter() - t0:.0f} s")


def plain_time(fn: Callable[[], object], reps: int = 2) -> float:
    """Median host milliseconds of fn (CPU: the interpreter)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; NaN anywhere (rows the kernel did not write) gives NaN."""
    diff = (a.float() - b.float()).abs()
    return float("nan") if diff.isnan().any() else diff.max().item()


def check_default(batch: Batch, work: Workload) -> tuple[float, torch.Tensor]:
    """(max abs error of the default config against the PyTorch reference, the default's output)."""
    from batchinfer.kernels import reference

    batch.out.fill_(float("nan"))
    out = kernel_call(batch, work, DEFAULT_CONFIG)().clone()
    expected = reference.paged_attention(
        batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale
    )
    return max_diff(out, expected), out


def sweep_one(
    shape: tuple[str, int, int, int], work: Workload, configs: list[Config], batch: Batch,
    timer: Callable[[Callable[[], object]], float], default_out: torch.Tensor, tolerance: float,
) -> list[Result]:
    """Every config of one (shape, workload), one short line each; a config whose output differs from
    the default's by tolerance or more is marked DIFF (and never the best)."""
    name, num_heads, num_kv_heads, head_dim = shape
    flops = causal_flops(work, num_heads, head_dim)
    nbytes = kv_bytes(work, num_kv_heads, head_dim, batch.k_cache.element_size())
    results = []
    default_ms = None
    for config in configs:
        label = config_name(config)
        batch.out.fill_(float("nan"))
        try:
            ms = timer(kernel_call(batch, work, config))
        except Exception as exc:  # noqa: BLE001 (out of shared memory, unsupported tile)
            print(f"  {label:<12} failed: {type(exc).__name__}: {str(exc)[:60]}")
            results.append(Result(name, work.name, label, None, None, None, error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        if config == DEFAULT_CONFIG:
            default_ms = ms
        diff = max_diff(batch.out, default_out)
        ratio = f"x{default_ms / ms:.2f}" if default_ms else ""
        flag = "" if diff < tolerance else f" DIFF {diff:.1e}"
        print(f"  {label:<12} {ms:8.3f} ms {flops / ms / 1e9:6.1f} TF/s {nbytes / ms / 1e6:6.0f} GB/s {ratio}{flag}")
        results.append(Result(name, work.name, label, ms, flops / ms / 1e9, nbytes / ms / 1e6, diff))
    return results


def best_of(results: list[Result], tolerance: float) -> Result | None:
    timed = [r for r in results if r.ms is not None and r.diff is not None and r.diff < tolerance]
    return min(timed, key=lambda r: r.ms or 0.0) if timed else None


def summary_row(results: list[Result], err: float, tolerance: float) -> dict:
    default = next((r for r in results if r.config == config_name(DEFAULT_CONFIG)), None)
    best = best_of(results, tolerance)
    default_ms = default.ms if default else None
    speedup = default_ms / best.ms if best and best.ms and default_ms else None
    return {
        "shape": results[0].shape, "workload": results[0].workload, "default_ms": default_ms,
        "best": best.config if best else None, "best_ms": best.ms if best else None,
        "speedup": speedup, "max_abs_err": err,
    }


def print_summary(rows: list[dict]) -> None:
    print(f"\n{'shape':<14}{'workload':<10}{'default ms':>11}  {'best':<12}{'best ms':>9}{'speedup':>8}{'err':>9}  check")
    for row in rows:
        dms = f"{row['default_ms']:.3f}" if row["default_ms"] else "failed"
        bms = f"{row['best_ms']:.3f}" if row["best_ms"] else "-"
        spd = f"x{row['speedup']:.2f}" if row["speedup"] else "-"
        print(f"{row['shape']:<14}{row['workload']:<10}{dms:>11}  {row['best'] or '-':<12}{bms:>9}{spd:>8}"
              f"{row['max_abs_err']:9.1e}  {'ok' if row['ok'] else 'BAD'}")


def run_sweep(
    shapes: list[tuple[str, int, int, int]], works: list[Workload], configs: list[Config],
    dtype: torch.dtype, device: str, timer: Callable[[Callable[[], object]], float], tolerance: float,
) -> tuple[list[Result], list[dict], bool]:
    """(every result, one summary row per (shape, workload), whether every check passed)."""
    results: list[Result] = []
    rows: list[dict] = []
    all_ok = True
    for s, shape in enumerate(shapes):
        name, num_heads, num_kv_heads, head_dim = shape
        for w, work in enumerate(works):
            batch = build_batch(work, num_heads, num_kv_heads, head_dim, dtype, device, seed=100 * s + w)
            err, default_out = check_default(batch, work)
            ok = err < tolerance
            gflop = causal_flops(work, num_heads, head_dim) / 1e9
            mb = kv_bytes(work, num_kv_heads, head_dim, batch.k_cache.element_size()) / 1e6
            print(f"{name} {num_heads}/{num_kv_heads}/{head_dim} {work.name}: {len(work.q_lens)} seqs, "
                  f"{sum(work.q_lens)} tok, {gflop:.1f} GFLOP, {mb:.0f} MB KV, err {err:.1e} {'ok' if ok else 'BAD'}")
            group = sweep_one(shape, work, configs, batch, timer, default_out, tolerance)
            ok = ok and all(r.diff is None or r.diff < tolerance for r in group)
            all_ok = all_ok and ok
            row = summary_row(group, err, tolerance)
            row["ok"] = ok
            if row["best"]:
                spd = f"x{row['speedup']:.2f} vs default" if row["speedup"] else "(default failed)"
                print(f"  * best {row['best']} {row['best_ms']:.3f} ms {spd}")
            results += group
            rows.append(row)
            del batch, default_out
    return results, rows, all_ok


def select_shapes(text: str | None) -> list[tuple[str, int, int, int]]:
    if not text:
        return SHAPES
    by_name = {s[0]: s for s in SHAPES}
    missing = [n for n in text.split(",") if n not in by_name]
    if missing:
        raise SystemExit(f"unknown shapes {missing} (known: {', '.join(by_name)})")
    return [by_name[n] for n in text.split(",")]


def cpu_smoke() -> None:
    """Tiny workloads through the Triton interpreter in float32, errors asserted."""
    from batchinfer.kernels.interpreter import triton_is_interpreted

    assert triton_is_interpreted(), "Triton was imported before TRITON_INTERPRET=1 was set"
    shapes = [("smoke-g2", 4, 2, 64)]
    configs = [DEFAULT_CONFIG, (16, 32, 2, 2)]
    _, rows, ok = run_sweep(shapes, smoke_workloads(), configs, torch.float32, "cpu", plain_time, SMOKE_TOLERANCE)
    print_summary(rows)
    for row in rows:
        assert row["max_abs_err"] < SMOKE_TOLERANCE and row["ok"], row
        assert row["default_ms"] is not None and row["best"] is not None, row
    assert ok
    print("cpu smoke ok")


def main() -> None:
    ap = argparse.ArgumentParser(description="Paged extend-attention launch sweep (see the module docstring).")
    ap.add_argument("--shapes", help=f"comma-separated names of {', '.join(s[0] for s in SHAPES)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of " + ", ".join(WORKLOADS))
    ap.add_argument("--configs", help="rows/n/warps/stages,... (the default 64/64/4/2 is always timed too)")
    ap.add_argument("--reps", type=int, default=10, help="CUDA-graph replays per config (median)")
    ap.add_argument("--out", help="write every result as JSON here")
    ap.add_argument("--compile-jobs", type=int, default=os.cpu_count() or 1,
                    help="threads compiling the kernels up front (0: compile as the sweep goes)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny check on CPU under the Triton interpreter")
    args = ap.parse_args()

    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels/interpreter.py)
        cpu_smoke()
        return
    shapes = select_shapes(args.shapes)
    rng = np.random.default_rng(0)
    works = [make_workload(n, rng) for n in args.workloads.split(",") if n]
    configs = parse_configs(args.configs) if args.configs else CONFIGS
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --cpu-smoke)")
    from batchinfer.bench.gpu_timing import graph_ms
    t0 = time.perf_counter()
    if args.compile_jobs > 0:
        precompile(shapes, configs, torch.bfloat16, args.compile_jobs)
    results, rows, ok = run_sweep(
        shapes, works, configs, torch.bfloat16, "cuda",
        lambda fn: graph_ms(fn, args.reps), GPU_TOLERANCE,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({
                "device": torch.cuda.get_device_name(), "block_size": BLOCK_SIZE, "dtype": "bfloat16",
                "configs": [config_name(c) for c in configs], "results": [asdict(r) for r in results],
                "summary": rows,
            }, f, indent=1)
    print(f"\n{torch.cuda.get_device_name()}, {time.perf_counter() - t0:.0f} s; ms = median of {args.reps} graph replays")
    print_summary(rows)
    if not ok:
        print(f"BAD: an error against the reference or a config's difference from the default >= {GPU_TOLERANCE}")
        sys.exit(1)


if __name__ == "__main__":
    main()
