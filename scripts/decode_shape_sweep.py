"""Decode attention launch sweep over eleven released attention shapes (MATRIX below): for each shape's
(query heads, KV heads, head_dim) and batch size, every launch config's effective KV bandwidth,
against the measured copy bandwidth. The data behind kernels/decode_attention.launch_config.

Contexts uniform in [100, 2048] tokens, 16-token blocks in shuffled order, bf16; or with --kv fp8 an
FP8 e4m3 cache (values stored x / scale and read back times it, as engine.kv_cache_dtype fp8_e4m3
does; bandwidth counts its 1-byte elements), by default over qwen3-0.6b and llama-3.1-8b, the
configs of FP8_CONFIGS at the rule's split count and its neighbours: under 2 minutes on the H200.
Its last line prints the kernels/decode_launch.py KV_TILES[1] entry to set (grid mode).
Usage (device tool): python3 scripts/decode_shape_sweep.py [--kv bf16|fp8] [--json out.json] [--batches 256,64,16,1]
  --mode grid (default): every (splits, block_n, warps, stages) of the "sequence" work split.
  --mode rule: per shape x batch, the old launch (query-head rows), the shape rule
    (kernels/decode_launch.py), the "balanced" work split at 1-8 programs per SM and both tiles,
    and a device copy of the same bytes (what a plain copy of that size reaches).
Offline (no GPU): python3 scripts/decode_shape_sweep.py --report sweep.json [--markdown out.md]
  prints default / rule / best per shape x batch as % of the copy bandwidth.
  --mode default: only the default launch, per shape x batch, once per --layouts entry (default
    "token"): "token" is the engine's cache, [blocks, block_size, kv_heads, head_dim]; "head" keeps
    each (block, KV head) contiguous, [blocks, kv_heads, block_size, head_dim] viewed through strides
    as the kernels' [blocks, block_size, kv_heads, head_dim].
"""
from __future__ import annotations

import itertools
import json
import sys

from batchinfer.kernels.decode_launch import launch_config

SMS_SWEPT = 132  # the H200 of sweep.json (the report evaluates the rule for this SM count)

# (name, query heads, KV heads, head_dim) of released models
MATRIX = [
    ("qwen2.5-7b", 28, 4, 128), ("qwen2.5-1.5b", 12, 2, 128), ("qwen2.5-0.5b", 14, 2, 64),
    ("smollm2-135m", 9, 3, 64), ("llama-3.2-3b", 24, 8, 128), ("qwen2.5-3b", 16, 2, 128),
    ("llama-3.2-1b", 32, 8, 64), ("llama-2-7b", 32, 32, 128), ("qwen1.5-0.5b", 16, 16, 64),
    ("qwen3-0.6b", 16, 8, 128), ("llama-3.1-8b", 32, 8, 128),
]


def rule_mode(res, q, k_cache, v_cache, tables, lens, out, b, hq, hkv, d, kv_bytes, dev, graph_time, attn) -> None:
    """--mode rule: res[name] = seconds per call for the old launch, the rule, balanced variants, a copy."""
    import torch

    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def run(key, **kw):
        try:
            res[key] = graph_time(lambda: attn(q, k_cache, v_cache, tables, lens, 0.088, out=out, **kw), reps=10)
        except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
            print(f"   {key} failed: {type(e).__name__}: {e}")

    sp, bn, w, st = map(int, old_launch(b, hq, hq // hkv, sms).split("/"))
    run("old", num_splits=sp, block_n=bn, num_warps=w, num_stages=st)
    rule = launch_config(b, hq, hkv, d, 2, sms)
    run("rule", num_splits=rule.splits, block_n=rule.block_n, num_warps=rule.num_warps, num_stages=rule.num_stages)
    for per_sm in (1, 2, 3, 4, 6, 8):
        for bn in sorted({rule.block_n, 128 if rule.block_n == 64 else 64}):
            c = launch_config(b, hq, hkv, d, 2, sms, work="balanced", programs_per_sm=per_sm)
            run(f"balanced/{per_sm}/{bn}", num_splits=c.splits, block_n=bn, num_warps=4, num_stages=2, work="balanced")
    src = torch.empty(kv_bytes // 2, dtype=torch.uint8, device=dev)  # a copy moving kv_bytes (read + write)
    dst = torch.empty_like(src)
    res["copy_same_bytes"] = graph_time(lambda: dst.copy_(src), reps=10)


def old_launch(b: int, hq: int, group: int, sms: int) -> str:
    """The launch before the shape rule: slices from query-head rows (60 per SM), block_n 128 for
    groups >= 4 else 64, 3 stages at 128."""
    sp = 1
    while sp < 16 and b * hq * sp < 60 * sms:
        sp *= 2
    bn = 128 if group >= 4 else 64
    return f"{sp}/{bn}/4/{3 if bn >= 128 else 2}"


def report(path: str, markdown: str | None) -> None:
    """default / rule / best of a --mode grid sweep, as % of the copy bandwidth."""
    d = json.load(open(path))
    copy = d["copy_bytes_per_s"]
    lines = ["| shape | q/kv heads (group) | head_dim | batch | KV MB | default | rule | best (config) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    ratios = {"default": [], "rule": []}
    if any(r.get("mode") == "rule" for r in d["rows"]):
        lines = ["| shape | q/kv heads (group) | head_dim | batch | KV MB | old | rule | balanced best (per SM/block_n) | "
                 "copy of the same bytes |", "|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in d["rows"]:
        pct = lambda t: 100 * r["kv_bytes"] / t / copy  # noqa: E731
        res = r["results"]
        if r.get("mode") == "rule":
            bal = {k: t for k, t in res.items() if k.startswith("balanced/")}
            bb = min(bal, key=bal.get) if bal else None
            cell = lambda k: f"{pct(res[k]):.0f}%" if k in res else "-"  # noqa: E731
            lines.append(f"| {r['shape']} | {r['hq']}/{r['hkv']} ({r['hq'] // r['hkv']}) | {r['d']} | {r['batch']} | "
                         f"{r['kv_bytes'] / 1e6:.0f} | {cell('old')} | {cell('rule')} | "
                         + (f"{pct(bal[bb]):.0f}% ({bb.split('/', 1)[1]})" if bb else "-") + f" | {cell('copy_same_bytes')} |")
            continue
        c = launch_config(r["batch"], r["hq"], r["hkv"], r["d"], 2, SMS_SWEPT)
        rule = f"{c.splits}/{c.block_n}/{c.num_warps}/{c.num_stages}"
        best = min(res, key=res.get)
        ratios["default"].append(res[best] / r["default_s"])
        ratios["rule"].append(res[best] / res[rule])
        lines.append(f"| {r['shape']} | {r['hq']}/{r['hkv']} ({r['hq'] // r['hkv']}) | {r['d']} | {r['batch']} | "
                     f"{r['kv_bytes'] / 1e6:.0f} | {pct(r['default_s']):.0f}% | {pct(res[rule]):.0f}% ({rule}) | "
                     f"{pct(res[best]):.0f}% ({best}) |")
    for k, v in ratios.items():
        if not v:
            continue
        lines.append(f"\n{k}: mean {100 * sum(v) / len(v):.1f}% of the best config's bandwidth, worst {100 * min(v):.1f}%")
    text = "\n".join(lines)
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text + "\n")


# --kv fp8: (block_n, warps, stages); the current rule's tiles, deeper pipelines and wider tiles
FP8_CONFIGS = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3),
               (256, 4, 2), (256, 8, 2)]
FP8_SHAPES = ["qwen3-0.6b", "llama-3.1-8b"]
KV_SCALE = 0.05  # |randn| <= ~5 stored as <= ~100: inside e4m3's range, away from its subnormals


def recommend_kv_tiles(rows: list[dict], kv_bytes: int) -> tuple[int, int, int] | None:
    """The (tile elements, warps, stages) with the best geometric-mean time over the rows (each at
    the rule's split count), printed as the KV_TILES entry to set."""
    import math

    from batchinfer.kernels.decode_launch import KV_TILES

    scores = {}
    for key in {(bn * r["d"], w, st) for r in rows for bn, w, st in FP8_CONFIGS}:
        logs = []
        for r in rows:
            t = r["results"].get("/".join(map(str, (r["splits"], key[0] // r["d"], key[1], key[2]))))
            if t is None:
                break
            logs.append(math.log(t / r["default_s"]))
        else:
            scores[key] = math.exp(sum(logs) / len(logs))
    if not scores:
        return None
    best = min(scores, key=scores.get)
    print(f"recommend KV_TILES[{kv_bytes}] = {best}  # {1 / scores[best]:.3f}x the current {KV_TILES[kv_bytes]} "
          f"(geometric mean over {', '.join(sorted({r['shape'] for r in rows}))} x batches)")
    return best


def random_kv(num_blocks: int, block: int, hkv: int, d: int, layout: str, dev, fp8: bool, scale: float):
    """Random K and V caches [blocks, block, kv_heads, d] in the engine's `layout` (allocated by
    engine/kv_cache.allocate_kv_cache, so "head" is the engine's head-major storage seen through its
    strides), bf16 or, with fp8, stored as FP8 e4m3 x / scale (the conversion keeps the strides)."""
    import torch

    from batchinfer.engine.kv_cache import allocate_kv_cache

    pair = allocate_kv_cache(1, num_blocks, block, hkv, d, torch.bfloat16, dev, layout)[0]
    for c in pair:
        c.normal_()
    return [(c.float() / scale).to(torch.float8_e4m3fn) for c in pair] if fp8 else list(pair)


def random_tables(num_blocks: int, max_b: int, max_ctx: int, block: int, gen, dev):
    """Shuffled block tables [max_b, max_ctx / block] (on dev) and context lengths uniform in
    [100, max_ctx] (int32, on the host)."""
    import torch

    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(max_b, max_ctx // block).to(dev)
    return tables, torch.randint(100, max_ctx + 1, (max_b,), generator=gen, dtype=torch.int32)


def default_mode(name, hq, hkv, d, batches, num_blocks, block, max_ctx, fp8, scale, copy, gen, dev, layouts, rows) -> None:
    """--mode default: the default launch's bandwidth per batch, for each cache layout."""
    import torch

    from batchinfer.kernels.decode_attention import paged_decode_attention

    sys.path.insert(0, "scripts")
    from bench_decode_kernels import graph_time

    tables, lens_all = random_tables(num_blocks, max(batches), max_ctx, block, gen, dev)
    print(f"\n== {name}: {hq} q / {hkv} kv heads (group {hq // hkv}), d {d}")
    for layout in layouts:
        k_cache, v_cache = random_kv(num_blocks, block, hkv, d, layout, dev, fp8, scale)
        for b in batches:
            lens = lens_all[:b].to(dev)
            q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            kv_bytes = int(lens.sum()) * hkv * d * 2 * (1 if fp8 else 2)
            t = graph_time(lambda: paged_decode_attention(q, k_cache, v_cache, tables[:b], lens, 0.088, out=out,
                                                          k_scale=scale, v_scale=scale), reps=10)
            print(f"{layout:5s} B={b:4d} {kv_bytes / t / 1e9:5.0f} GB/s ({100 * kv_bytes / t / copy:3.0f}% of copy)")
            rows.append(dict(shape=name, layout=layout, batch=b, kv="fp8" if fp8 else "bf16", kv_bytes=kv_bytes, default_s=t))
        k_cache = v_cache = None  # freed before the next layout's
        torch.cuda.empty_cache()


def main() -> None:
    args = sys.argv[1:]
    if "--report" in args:
        report(args[args.index("--report") + 1], args[args.index("--markdown") + 1] if "--markdown" in args else None)
        return
    import torch

    from batchinfer.bench.roofline import measure_ceilings
    from batchinfer.kernels.decode_attention import paged_decode_attention

    sys.path.insert(0, "scripts")
    from bench_decode_kernels import graph_time

    mode = args[args.index("--mode") + 1] if "--mode" in args else "grid"
    layouts = (args[args.index("--layouts") + 1] if "--layouts" in args else "token").split(",")
    from batchinfer.engine.kv_cache import KV_LAYOUTS

    if not set(layouts) <= set(KV_LAYOUTS):
        raise SystemExit(f"--layouts entries must be among {', '.join(KV_LAYOUTS)}, not {args[args.index('--layouts') + 1]!r}")
    kv = args[args.index("--kv") + 1] if "--kv" in args else "bf16"
    if kv not in ("bf16", "fp8"):
        raise SystemExit(f"--kv must be bf16 or fp8, not {kv!r}")
    fp8 = kv == "fp8"
    kv_el, scale = (1, KV_SCALE) if fp8 else (2, 1.0)
    out_json = args[args.index("--json") + 1] if "--json" in args else None
    batches = [int(b) for b in (args[args.index("--batches") + 1] if "--batches" in args else "256,64,8").split(",")]
    dev = torch.device("cuda")
    ceil = measure_ceilings(dev)
    copy = ceil.copy_bytes_per_s
    print(f"copy bandwidth {copy / 1e9:.0f} GB/s")
    gen = torch.Generator().manual_seed(0)
    block, max_ctx = 16, 2048
    configs = FP8_CONFIGS if fp8 else [(32, 4, 2), (64, 4, 2), (64, 8, 2), (128, 4, 2), (128, 4, 3), (128, 8, 2), (128, 8, 3)]
    rows = []
    only = args[args.index("--shapes") + 1].split(",") if "--shapes" in args else (FP8_SHAPES if fp8 else None)
    for name, hq, hkv, d in MATRIX:
        if only and name not in only:
            continue
        max_b = max(batches)
        num_blocks = max_b * max_ctx // block
        if mode == "default":
            default_mode(name, hq, hkv, d, batches, num_blocks, block, max_ctx, fp8, scale, copy, gen, dev, layouts, rows)
            continue
        k_cache, v_cache = random_kv(num_blocks, block, hkv, d, "token", dev, fp8, scale)
        tables, lens_all = random_tables(num_blocks, max_b, max_ctx, block, gen, dev)
        print(f"\n== {name}: {hq} q / {hkv} kv heads (group {hq // hkv}), d {d}")
        for b in batches:
            lens = lens_all[:b].to(dev)
            q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
            out = torch.empty_like(q)
            kv_bytes = int(lens.sum()) * hkv * d * 2 * kv_el
            rule_splits = launch_config(b, hq, hkv, d, kv_el, torch.cuda.get_device_properties(dev).multi_processor_count).splits
            res = {}
            if mode == "rule":
                rule_mode(res, q, k_cache, v_cache, tables[:b], lens, out, b, hq, hkv, d, kv_bytes, dev, graph_time,
                          paged_decode_attention)
            split_counts = sorted({max(rule_splits // 2, 1), rule_splits, min(rule_splits * 2, 16)}) if fp8 else (1, 2, 4, 8, 16)
            for (bn, w, st), sp in itertools.product(configs if mode == "grid" else (), split_counts):
                try:
                    res[(sp, bn, w, st)] = graph_time(lambda: paged_decode_attention(
                        q, k_cache, v_cache, tables[:b], lens, 0.088, num_splits=sp, block_n=bn, out=out,
                        num_warps=w, num_stages=st, k_scale=scale, v_scale=scale), reps=10)
                except Exception as e:  # noqa: BLE001 (out of shared memory etc.)
                    print(f"   {sp}sp {bn}n {w}w{st}s failed: {type(e).__name__}")
            default = graph_time(lambda: paged_decode_attention(q, k_cache, v_cache, tables[:b], lens, 0.088, out=out,
                                                                k_scale=scale, v_scale=scale), reps=10)
            if mode == "rule":
                line = ", ".join(f"{k} {100 * kv_bytes / t / copy:.0f}%" for k, t in res.items())
                print(f"B={b:4d} ({kv_bytes / 1e6:.0f} MB) % of copy: {line}")
                rows.append(dict(shape=name, hq=hq, hkv=hkv, d=d, batch=b, kv_bytes=kv_bytes, default_s=default,
                                 mode="rule", results=res))
                continue
            best = min(res, key=res.get)
            gbs = lambda t: kv_bytes / t / 1e9  # noqa: E731
            top = sorted(res, key=res.get)[:4]
            print(f"B={b:4d} default {gbs(default):5.0f} GB/s ({100 * gbs(default) * 1e9 / copy:3.0f}% of copy) | best "
                  f"{gbs(res[best]):5.0f} ({100 * gbs(res[best]) * 1e9 / copy:3.0f}%) @ {best} | top "
                  + "; ".join(f"{k} {gbs(res[k]):.0f}" for k in top))
            rows.append(dict(shape=name, hq=hq, hkv=hkv, d=d, batch=b, kv=kv, kv_bytes=kv_bytes, default_s=default,
                             splits=rule_splits, results={"/".join(map(str, k)): t for k, t in res.items()}))
        if out_json:  # after every shape: a run cut short keeps what it measured
            with open(out_json, "w") as f:
                json.dump(dict(copy_bytes_per_s=copy, rows=rows), f)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    if mode == "grid":
        best = recommend_kv_tiles(rows, kv_el)
        if out_json:
            with open(out_json, "w") as f:
                json.dump(dict(copy_bytes_per_s=copy, kv=kv, rows=rows, recommend_kv_tiles=best), f)


if __name__ == "__main__":
    main()
