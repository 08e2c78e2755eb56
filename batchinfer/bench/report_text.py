"""`bench throughput`'s report as text (what it prints) and as JSON (what --out keeps)."""

from __future__ import annotations

import json
from pathlib import Path

from batchinfer.engine.kv_calibration import describe as describe_kv_scales


def format_report(r: dict) -> str:
    """The text `bench throughput` prints for a report of measure_workload (or of a data-parallel run)."""
    f = r["floor"]
    lines = [
        f"workload {r['workload']} ({r['description']})",
        f"model {r['model']} on {r['device']} ({r['dtype']}"
        + (f", {r['quantization']} weights" if r.get("quantization", "none") != "none" else "")
        + (f", {r['kv_cache_dtype']} KV cache" if r.get("kv_cache_dtype", "auto") != "auto" else "")
        + f"); {r['requests']} requests, {r['errors']} errors",
        *([f"KV scales calibrated: {describe_kv_scales(r['kv_scales'])}"] if r.get("kv_scales") else []),
        f"elapsed {r['elapsed_s']:.2f} s: {r['requests_per_s']:.2f} req/s, "
        f"{r['output_tokens_per_s']:,.0f} output tok/s, {r['total_tokens_per_s']:,.0f} total tok/s",
        f"ceilings: copy {r['ceilings']['copy_GBps']:,.0f} GB/s, matmul {r['ceilings']['matmul_TFLOPs']:,.1f} TFLOP/s",
        f"roofline floor {f['floor_s']:.2f} s ({f['bound']}-bound: compute {f['compute_s']:.2f} s, memory {f['memory_s']:.2f} s; "
        f"concurrency {f['concurrency']}, min steps {f['min_steps']}) = {r['floor_output_tokens_per_s']:,.0f} output tok/s",
        f"achieved / floor: {100 * r['fraction_of_roofline']:.1f}% of the roofline",
    ]
    if (r.get("quantization", "none") != "none" or r.get("kv_cache_dtype", "auto") != "auto") and r.get("floors"):
        c = r["ceilings"].get("fp8_matmul_TFLOPs")
        for key, label in (("bf16", "16-bit floor (16-bit weights, KV and matrix rate)"),
                           ("fp8", "FP8 floor (FP8 weights and KV bytes, FP8 matrix rate "
                                   f"{f'{c:,.1f} TFLOP/s' if c else 'n/a: the 16-bit rate'})")):
            fl = r["floors"][key]
            lines.append(f"  vs {label}: {fl['floor_s']:.2f} s ({fl['bound']}-bound) = {fl['output_tokens_per_s']:,.0f} output tok/s; "
                         f"achieved {100 * fl['fraction']:.1f}%")
    if r.get("prefill_policy", "budget") != "budget":
        lines.append(f"prefill policy {r['prefill_policy']}: held prefill back in {r['prefill_limited_steps']:,} of {r['steps']:,} steps")
    if r.get("cpu_share_of_step") is not None:
        lines.append(
            f"steps {r['steps']} (decode-only {r['decode_steps']}), mean step {r['step_ms_mean']:.2f} ms, "
            f"CPU scheduling {r['cpu_schedule_ms_mean']:.3f} ms = {100 * r['cpu_share_of_step']:.1f}% of step time"
        )
    do = r.get("decode_only")
    if do and do["output_tokens_per_s"]:
        lines.append(f"decode-only steps: {do['steps']:,}, {do['output_tokens']:,} output tokens in {do['seconds']:.2f} s = "
                     f"{do['output_tokens_per_s']:,.0f} output tok/s")
    sp = r.get("speculative")
    if sp:
        fmt = lambda x, p="": "n/a" if x is None else f"{x:.2f}{p}"  # noqa: E731
        lines.append(
            f"speculative: drafted {sp['drafted']:,}, verified {sp['verified']:,}, accepted {sp['accepted']:,} "
            f"(acceptance {fmt(sp['acceptance'])}); mean accepted per sequence-step {fmt(sp['mean_accepted_per_seq_step'])}; "
            f"tokens per sequence per forward {fmt(sp['tokens_per_seq_per_forward'])}"
            + {True: "; verify steps in two lanes", False: "; verify steps serial"}.get(sp.get("lanes"), "")
            + (f"; oracle corrupt {r['oracle_corrupt']}" if r.get("oracle_corrupt") is not None else "")
        )
        gate = r.get("speculation_gate")
        if gate:
            rates = "; ".join(
                f"{rows}+ seqs: " + ", ".join(f"{m} {'n/a' if v is None else f'{v:,.0f}'}" for m, v in modes.items())
                for rows, modes in gate["tokens_per_s"].items()
            )
            lines.append(f"speculation gate: {gate['steps']['speculate']:,} steps with drafts, {gate['steps']['plain']:,} plain"
                         f" (tokens/s by running sequences: {rates})")
        for name, c in (sp.get("sources") or {}).items():
            label = {"forced": "grammar-forced", "text": "grammar-text"}.get(name, name)
            if name == "ngram" and r.get("oracle_corrupt") is not None:
                label = "oracle"
            lines.append(
                f"  {label:>14} drafts: drafted {c['drafted']:,}, verified {c['verified']:,}, accepted {c['accepted']:,} "
                f"(acceptance {fmt(c['acceptance'])}); accepted tokens per sequence per forward {fmt(c['accepted_per_decode_row'])}"
            )
    if r.get("graphs_captured_during_run"):
        lines.append(f"CUDA graph sizes captured on first use during the measured run: {r['graphs_captured_during_run']}"
                     + (" (the plain twin, run after it on the same engine, found them ready)" if r.get("plain_twin") else ""))
    if r.get("kernels_compiled_during_run"):
        lines.append("Triton kernels compiled during the measured run (each costs ~1 s): "
                     + ", ".join(f"{k} x{n}" for k, n in r["kernels_compiled_during_run"].items()))
    for g in r.get("step_breakdown") or []:
        lines.append(
            f"  {g['group']:>20}: {g['steps']:5d} steps, {g['time_s']:6.2f} s ({100 * g['share']:4.1f}%), "
            f"step {g['mean_step_ms']:7.2f} ms (max {g['max_step_ms']:7.2f}) vs floor {g['mean_floor_ms']:7.2f} ms "
            f"({100 * (g['fraction_of_floor'] or 0):4.1f}%), {g['mean_tokens']:6.0f} tokens, {g['mean_kv_tokens']:8.0f} KV tokens"
            + (f", step cost model {g['mean_model_ms']:7.2f} ms" if g.get("mean_model_ms") is not None else "")
        )
    groups = r.get("step_breakdown") or []
    if groups:
        big = max(groups, key=lambda g: g["share"])
        phases = ", ".join(f"{k} {v:.2f}" for k, v in big.get("mean_host_phases_ms", {}).items())
        lines.append(f"  host ms per step in '{big['group']}' (device idle {big.get('mean_device_idle_ms', 0):.2f}): {phases}")
        full = next((g for g in groups if g["group"] == "decode 193+ rows"), None)
        if full is not None and full is not big:
            phases = ", ".join(f"{k} {v:.2f}" for k, v in full.get("mean_host_phases_ms", {}).items())
            lines.append(f"  host ms per step in '{full['group']}' (device idle {full.get('mean_device_idle_ms', 0):.2f}): {phases}")
    tw = r.get("plain_twin")
    if tw:
        full = next((g for g in tw["step_breakdown"] if g["group"] == "decode 193+ rows"), None)
        lines.append(f"plain twin (the same prompts and output lengths, no constraint): {tw['elapsed_s']:.2f} s, "
                     f"{tw['output_tokens_per_s']:,.0f} output tok/s; constrained = {100 * tw['constrained_share']:.1f}% of it"
                     + (f"; its decode 193+ step {full['mean_step_ms']:.2f} ms" if full is not None else "")
                     + (f"; graph sizes captured during it {tw['graphs_captured_during_run']}"
                        if tw["graphs_captured_during_run"] else ""))
        again = tw.get("constrained_again")
        if again:
            lines.append(f"constrained again, after the twin on the same engine: {again['elapsed_s']:.2f} s, "
                         f"{again['output_tokens_per_s']:,.0f} output tok/s = {100 * again['share']:.1f}% of the twin"
                         f"; graph sizes captured during it {again['graphs_captured_during_run']}")
    gm = r.get("grammar_masks")
    if gm:
        total = gm["computed"] + gm["copied"] + gm["cached"]
        lines.append(f"grammar masks: {total:,} rows: computed {gm['computed']:,} ({100 * gm['computed'] / total:.1f}%), "
                     f"copied within a step {gm['copied']:,}, from the cache {gm['cached']:,}; fills ran {gm['fill_s']:.2f} s; "
                     f"cache holds {gm.get('kept', 0):,} masks ({gm.get('evicted', 0):,} evicted)")
    if r.get("data_parallel", 1) > 1:
        lines.append(
            f"data parallel: {r['data_parallel']} engines, aggregate {r['output_tokens_per_s']:,.0f} output tok/s; "
            f"floor x {r['data_parallel']} = {r['floor_x_n_output_tokens_per_s']:,.0f} output tok/s; per engine: "
            + ", ".join(f"{e['output_tokens_per_s']:,.0f}" for e in r["per_engine"])
        )
    return "\n".join(lines)


def write_report(r: dict, out: Path) -> None:
    """The report as JSON at `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2, default=str))
