"""A measured run's steps summed up: by kind of step against each kind's own floor (step_breakdown),
the decode-only output rate, and the speculative counts (bench/throughput.py reports them)."""

from __future__ import annotations


def spec_summary(steps) -> dict:
    """Speculative decoding totals over the measured steps (StepStats spec_*)."""
    keys = ("drafted", "verified", "accepted", "rows", "decode_rows", "emitted")
    tot = {k: sum(getattr(s, f"spec_{k}", 0) for s in steps) for k in keys}
    tot["acceptance"] = tot["accepted"] / tot["verified"] if tot["verified"] else None
    tot["mean_accepted_per_seq_step"] = tot["accepted"] / tot["rows"] if tot["rows"] else None
    tot["tokens_per_seq_per_forward"] = tot["emitted"] / tot["decode_rows"] if tot["decode_rows"] else None
    parts = ("drafted", "verified", "accepted")
    forced = {k: sum(getattr(s, f"spec_forced_{k}", 0) for s in steps) for k in parts}
    text = {k: sum(getattr(s, f"spec_text_{k}", 0) for s in steps) for k in parts}
    other = {k: tot[k] - forced[k] - text[k] for k in parts}
    tot["sources"] = {}
    # forced: the grammar's forced tokens; text: the forced text's tokens after them; ngram: n-gram
    # lookup or the bench's drafter (oracle) (engine/drafts.py)
    for name, c in (("forced", forced), ("text", text), ("ngram", other)):
        tot["sources"][name] = {**c, "acceptance": c["accepted"] / c["verified"] if c["verified"] else None,
                                "accepted_per_decode_row": c["accepted"] / tot["decode_rows"] if tot["decode_rows"] else None}
    return tot


def decode_only_rate(steps) -> dict | None:
    """Output tokens per second of the decode-only steps (no prefill token): how issue 15 measures
    speculation. A verify step emits its spec_emitted tokens, a plain one a token per decoding row;
    the seconds are the steps' loop time (with overlap a step's tokens are read in the next one, which
    evens out over a run). None without such steps."""
    steps = [s for s in steps if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    if not steps:
        return None
    tokens = sum(s.spec_emitted if s.spec_decode_rows else s.num_decode_tokens for s in steps)
    seconds = sum(s.step_ms for s in steps) / 1e3
    return {"steps": len(steps), "output_tokens": tokens, "seconds": seconds,
            "output_tokens_per_s": tokens / seconds if seconds > 0 else None}


STEP_BUCKETS = ((1, 16), (17, 64), (65, 128), (129, 192), (193, 1 << 30))
READS_ONLY = "reads only"  # step_breakdown's group of iterations that launched no step


def step_breakdown(
    steps,
    *,
    weight_bytes: int,
    kv_bytes_per_token: int,
    block_size: int,
    flops_per_token: float,
    lm_head_flops: float,
    copy_bytes_per_s: float,
    matmul_flops_per_s: float,
    layer_flops_per_s: float | None = None,
    step_cost=None,
) -> list[dict]:
    """Where the measured time went: steps grouped by kind (steps with prefill tokens; decode-only
    steps by their number of rows; iterations that only read steps in flight, READS_ONLY), each
    group's wall time against its own per-step floor.

    A step's floor is the larger of (weights + its KV) over the copy bandwidth and its tokens' layer
    FLOPs (at layer_flops_per_s: FP8's with FP8 weights) plus the LM head of its decode rows (and
    drafts) over the matrix rate. Its KV is the fewer of every block in use and the positions its
    sequences' attention covers (StepStats.num_context_tokens): both can only overstate the bytes a
    step must read (whole blocks; a shared prefix once per sequence), so the floor is a little
    generous, never too strict. The second matters for a lane's step (speculative decoding), which
    reads its own lane's KV, not the other's.

    step_cost: an engine.step_cost.StepCost; each group then also gets `mean_model_ms`, what that
    model (the prefill policy's: kernels one after another, each bound by its FLOPs or bytes) says
    its steps take, with the KV in use as the decode rows' context and prefill chunks as new tokens.
    """
    groups: dict[str, dict] = {}
    for s in steps:
        # decoding sequences' tokens: one each, plus the drafts a verify step computes (each a token of
        # the layers and a row of the LM head)
        rows = s.num_decode_tokens + s.num_draft_tokens
        if not rows and not s.num_prefill_tokens:
            # an iteration that launched nothing, only read steps in flight (the plain loop's last
            # step; lanes drained): its time is the device finishing those steps plus the host's
            # reading, so it has no floor of its own but belongs in the run's time
            key = READS_ONLY
        elif s.num_prefill_tokens:
            key = "prefill/mixed"
        else:
            seqs = s.num_decode_tokens
            lo, hi = next(b for b in STEP_BUCKETS if b[0] <= seqs <= b[1])
            key = f"decode {lo}-{hi} rows" if hi < (1 << 30) else f"decode {lo}+ rows"
        g = groups.setdefault(key, {"steps": 0, "ms": 0.0, "max_ms": 0.0, "floor_ms": 0.0, "tokens": 0, "kv_tokens": 0,
                                    "idle_ms": 0.0, "phases": {}, "model_ms": 0.0})
        kv_tokens = s.kv_blocks_used * block_size
        if s.num_context_tokens:  # (0: not known)
            kv_tokens = min(kv_tokens, s.num_context_tokens)
        tokens = s.num_prefill_tokens + rows
        mem = (weight_bytes + kv_tokens * kv_bytes_per_token) / copy_bytes_per_s if tokens else 0.0
        comp = tokens * flops_per_token / (layer_flops_per_s or matmul_flops_per_s) + rows * lm_head_flops / matmul_flops_per_s
        g["steps"] += 1
        g["ms"] += s.step_ms
        g["max_ms"] = max(g["max_ms"], s.step_ms)
        g["idle_ms"] += s.schedule_ms
        for name, ms in getattr(s, "phases_ms", {}).items():
            g["phases"][name] = g["phases"].get(name, 0.0) + ms
        g["floor_ms"] += 1e3 * max(mem, comp)
        if step_cost is not None and tokens:
            g["model_ms"] += 1e3 * step_cost.seconds(rows, kv_tokens if rows else 0, s.num_prefill_tokens)
        g["tokens"] += tokens
        g["kv_tokens"] += kv_tokens
    total = sum(g["ms"] for g in groups.values()) or 1.0
    out = []
    for key, g in sorted(groups.items()):
        n = g["steps"]
        out.append({
            "group": key, "steps": n, "time_s": g["ms"] / 1e3, "share": g["ms"] / total,
            "mean_step_ms": g["ms"] / n, "max_step_ms": g["max_ms"], "mean_floor_ms": g["floor_ms"] / n,
            "fraction_of_floor": g["floor_ms"] / g["ms"] if g["ms"] and key != READS_ONLY else None,
            "mean_tokens": g["tokens"] / n, "mean_kv_tokens": g["kv_tokens"] / n,
            "mean_device_idle_ms": g["idle_ms"] / n,
            "mean_model_ms": g["model_ms"] / n if step_cost is not None else None,
            "mean_host_phases_ms": {k: v / n for k, v in g["phases"].items()},
        })
    return out
