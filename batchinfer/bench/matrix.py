"""`batchinfer bench matrix`: `bench throughput` over the shape matrix (bench/shapes.py MATRIX) in
one process: the ceilings measured once, one engine per shape (built once, every workload measured
on it), and per shape x workload the output rate, the share of the roofline floor and each step
kind (decode-only steps by their rows, prefill/mixed) against its own per-step floor
(step_breakdown.step_breakdown). The markdown table is the one BENCHMARKS.md keeps.
"""

from __future__ import annotations

import gc
import json
import time
from pathlib import Path

import torch

from batchinfer.bench.roofline import measure_ceilings
from batchinfer.bench.shapes import SHAPES
from batchinfer.bench.step_breakdown import READS_ONLY, STEP_BUCKETS
from batchinfer.bench.throughput import BenchEngine, bench_engine_config, measure_workload

# The step kinds of the table, in order (step_breakdown.step_breakdown's group names).
STEP_KINDS = tuple(f"decode {lo}-{hi} rows" if hi < (1 << 30) else f"decode {lo}+ rows" for lo, hi in STEP_BUCKETS) + (
    "prefill/mixed", READS_ONLY,
)


def shape_summary(name: str) -> dict:
    """What the table says of a shape (a bench shape's config; a model folder: its config.json)."""
    c = SHAPES[name] if name in SHAPES else json.loads((Path(name) / "config.json").read_text())
    hq, hkv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
    return {
        "hidden": c["hidden_size"], "layers": c["num_hidden_layers"], "q_heads": hq, "kv_heads": hkv,
        "group": hq // hkv, "head_dim": c.get("head_dim") or c["hidden_size"] // hq,
        "tied": bool(c.get("tie_word_embeddings", False)), "vocab": c["vocab_size"],
    }


def matrix_row(shape: str, report: dict) -> dict:
    """One shape x workload row from a run_throughput / measure_workload report."""
    kinds = {g["group"]: {"share": g["share"], "fraction_of_floor": g["fraction_of_floor"], "steps": g["steps"],
                          "mean_step_ms": g["mean_step_ms"], "mean_floor_ms": g["mean_floor_ms"]}
             for g in report.get("step_breakdown") or []}
    return {
        "shape": shape, **shape_summary(shape), "workload": report["workload"],
        "requests": report["requests"], "errors": report["errors"], "output_tokens": report["output_tokens"],
        "elapsed_s": report["elapsed_s"], "load_s": report["load_s"],
        "output_tokens_per_s": report["output_tokens_per_s"], "floor_output_tokens_per_s": report["floor_output_tokens_per_s"],
        "fraction_of_roofline": report["fraction_of_roofline"], "bound": report["floor"]["bound"],
        "step_kinds": kinds,
    }


def run_matrix(
    shapes: list[str],
    workloads: list[str],
    *,
    scale: float = 1.0,
    count_scale: float | None = None,
    engine_overrides: dict | None = None,
    cache_dir: Path | None = None,
    log=print,
    on_row=None,
) -> dict:
    """Every workload on every shape; returns {"device", "ceilings", "scale", "count_scale", "rows", "wall_s"}.
    on_row(result so far) after every row: a run cut short keeps what it measured."""
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceilings = measure_ceilings(device)
    rows: list[dict] = []

    def result() -> dict:
        return {
            "device": ceilings.device,
            "ceilings": {"copy_GBps": ceilings.copy_bytes_per_s / 1e9, "matmul_TFLOPs": ceilings.matmul_flops_per_s / 1e12},
            "scale": scale, "count_scale": count_scale, "engine_overrides": engine_overrides or {},
            "rows": rows, "wall_s": time.perf_counter() - t_start,
        }

    for shape in shapes:
        cfg = bench_engine_config(shape, engine_overrides, cache_dir)
        t_load = time.perf_counter()
        bench = BenchEngine(cfg)
        load_s = time.perf_counter() - t_load
        try:
            for workload in workloads:
                report = measure_workload(bench, shape, workload, ceilings, scale=scale, count_scale=count_scale, load_s=load_s)
                rows.append(matrix_row(shape, report))
                log(format_row(rows[-1]))
                if on_row is not None:
                    on_row(result())
        finally:
            bench.close()
            del bench
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return result()


def _kind_cell(row: dict, kind: str) -> str:
    k = row["step_kinds"].get(kind)
    if k is None:
        return "-"
    if k["fraction_of_floor"] is None:  # no floor of its own (reads only): its share of the run
        return f"- ({100 * k['share']:.0f}%)"
    return f"{100 * k['fraction_of_floor']:.0f}% ({100 * k['share']:.0f}%)"


def format_row(row: dict) -> str:
    kinds = ", ".join(f"{kind} {_kind_cell(row, kind)}" for kind in STEP_KINDS if kind in row["step_kinds"])
    return (f"{row['shape']} x {row['workload']}: {row['output_tokens_per_s']:,.0f} output tok/s, "
            f"{100 * row['fraction_of_roofline']:.1f}% of the roofline floor ({row['bound']}-bound); "
            f"step kinds at % of their floor (share of the run): {kinds}")


def format_markdown(result: dict) -> str:
    """The table for BENCHMARKS.md: a row per shape x workload; each step kind's cell is its time
    against its own per-step floor, with its share of the run's step time in brackets."""
    kinds = [k for k in STEP_KINDS if any(k in r["step_kinds"] for r in result["rows"])]
    c = result["ceilings"]
    lines = [
        f"{result['device']}: copy {c['copy_GBps']:,.0f} GB/s, matmul {c['matmul_TFLOPs']:,.1f} TFLOP/s; "
        f"scale {result['scale']}" + (f", count scale {result['count_scale']}" if result.get("count_scale") is not None else "")
        + f"; {result['wall_s']:.0f} s in all.",
        "",
        "| shape | hidden | heads q/kv (group) | head_dim | tied | workload | output tok/s | % of floor | "
        + " | ".join(kinds) + " |",
        "|---|---:|---|---:|---|---|---:|---:|" + "---:|" * len(kinds),
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['shape']} | {r['hidden']} | {r['q_heads']}/{r['kv_heads']} ({r['group']}) | {r['head_dim']} | "
            f"{'yes' if r['tied'] else 'no'} | {r['workload']} | {r['output_tokens_per_s']:,.0f} | "
            f"{100 * r['fraction_of_roofline']:.1f}% | " + " | ".join(_kind_cell(r, k) for k in kinds) + " |"
        )
    return "\n".join(lines) + "\n"
