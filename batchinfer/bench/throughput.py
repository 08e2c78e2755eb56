"""`batchinfer bench throughput`: run a named workload and compare it with its roofline floor."""

from __future__ import annotations

import logging
import os
import platform
import statistics
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from batchinfer.bench.job_workload import is_job_file, job_workload
from batchinfer.bench.profile_window import (
    PROFILE_DECODE_ENV,
    PROFILE_ENV,
    PROFILE_START_ENV,
    PROFILE_STEPS_ENV,
    StepWindowProfiler,
    graphs_captured_on_use,
    jit_compiled_since,
    jit_snapshot,
)
from batchinfer.bench.roofline import measure_ceilings, workload_floor
from batchinfer.bench.shapes import SHAPES, write_shape
from batchinfer.bench.step_breakdown import (
    decode_only_rate,
    spec_summary,
    step_breakdown,
)
from batchinfer.bench.workloads import make_workload
from batchinfer.engine.config import EngineConfig
from batchinfer.engine.step_cost import StepCost
from batchinfer.io.model_files import kv_bytes_per_token
from batchinfer.models.loader import load_model_info

log = logging.getLogger(__name__)


def _model_folder(model: str, cache_dir: Path) -> tuple[str, str]:
    """(folder, load_format) for a shape name or a model folder."""
    if model in SHAPES:
        return str(write_shape(model, cache_dir / model)), "random"
    return model, "safetensors"












def load_workload(name: str, tokenizer, vocab_size: int, max_model_len: int, scale: float = 1.0, seed: int = 0,
                  shard: tuple[int, int] | None = None, count_scale: float | None = None):
    """A named workload (bench/workloads.py) or a job file's requests (bench/job_workload.py; scale
    and seed do not apply: the job's rows are the workload); `shard` (i, n) keeps requests i::n."""
    if is_job_file(name):
        wl = job_workload(name, tokenizer, max_model_len)
    else:
        wl = make_workload(name, vocab_size, seed=seed, scale=scale, count_scale=count_scale)
    if shard is not None:
        wl = replace(wl, requests=wl.requests[shard[0] :: shard[1]])
    return wl


def run_throughput(
    model: str,
    workload: str,
    engine_overrides: dict | None = None,
    scale: float = 1.0,
    cache_dir: Path | None = None,
    data_parallel: int | None = None,
    profile_dir: Path | None = None,
    shard: tuple[int, int] | None = None,
    before_measure=None,
    speculative: str | None = None,
    spec_tokens: int = 4,
    oracle_corrupt: float = 0.0,
    spec_gate: bool = False,
    plain_twin: bool = False,
    spec_lanes: bool | None = None,
    spec_prefill_first: bool = False,
    spec_lanes_drain: bool = True,
) -> dict:
    """Run `workload` on `model` (a shape name or folder); return the numbers as a dict.

    data_parallel N > 1: see run_throughput_data_parallel. shard (i, n): run only requests i::n of the
    workload (one engine of a data-parallel run); before_measure: called right before the timed run.

    profile_dir (or the BATCHINFER_PROFILE_DIR variable): profile a few steps of the measured run
    (after BATCHINFER_PROFILE_START steps, default 60; with BATCHINFER_PROFILE_DECODE_ROWS=N, from the first
    decode-only step of at least N rows after those) into that folder.

    speculative: ngram | grammar | ngram+grammar | oracle (engine.speculative with spec_tokens drafts);
    oracle: the workload runs plain once (untimed, its own engine) to record every request's output,
    then the measured run drafts that output with a share oracle_corrupt of draft tokens corrupted
    (bench/oracle.py). spec_gate: speculate only where it measures faster (engine.speculative.gate);
    spec_lanes: engine.speculative.lanes (None: the engine's default, lanes on a GPU).
    spec_prefill_first: engine.speculative.prefill_first (prompts, running then waiting, before drafts in a step's budget).
    spec_lanes_drain: engine.speculative.lanes_drain (lanes drained for plain steps while there is no room for drafts).
    plain_twin: see measure_workload.
    """
    if data_parallel not in (None, 1):
        return run_throughput_data_parallel(model, workload, data_parallel, engine_overrides, scale, cache_dir)

    cfg = bench_engine_config(model, engine_overrides, cache_dir)
    drafter = None
    if speculative is not None:
        if speculative not in ("ngram", "grammar", "ngram+grammar", "oracle"):
            raise ValueError(f"--speculative must be ngram, grammar, ngram+grammar or oracle, not {speculative!r}")
        if speculative == "oracle":
            drafter = _record_oracle(cfg, workload, scale, shard, spec_tokens, oracle_corrupt)
        method = "ngram+grammar" if speculative == "oracle" else speculative
        cfg = replace(cfg, speculative={"method": method, "num_tokens": spec_tokens, "gate": spec_gate, "lanes": spec_lanes,
                                          "prefill_first": spec_prefill_first, "lanes_drain": spec_lanes_drain})
    t_load = time.perf_counter()
    bench = BenchEngine(cfg, drafter)
    load_s = time.perf_counter() - t_load
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return measure_workload(bench, model, workload, measure_ceilings(device), scale=scale, shard=shard, load_s=load_s,
                                profile_dir=profile_dir, before_measure=before_measure, speculative=speculative,
                                oracle_corrupt=oracle_corrupt, plain_twin=plain_twin)
    finally:
        bench.close()


def bench_engine_config(model: str, engine_overrides: dict | None = None, cache_dir: Path | None = None) -> EngineConfig:
    """The engine config of a benchmark of `model` (a shape name: random weights; or a model folder)."""
    cache_dir = Path(cache_dir or Path(tempfile.gettempdir()) / "batchinfer-bench")
    folder, load_format = _model_folder(model, cache_dir)
    cfg = EngineConfig(model=folder, dtype="bfloat16" if torch.cuda.is_available() else "float32", load_format=load_format)
    return replace(cfg, **engine_overrides) if engine_overrides else cfg


class BenchEngine:
    """An engine for benchmark runs and the stats of the steps it ran (measure_workload clears them
    after its warm-up). `bench matrix` opens one per shape and measures several workloads on it."""

    def __init__(self, cfg: EngineConfig, drafter=None) -> None:
        from batchinfer.engine.engine import Engine

        self.cfg = cfg
        self.steps: list = []
        self.profiler: StepWindowProfiler | None = None
        self.engine = Engine(cfg, on_step=self._on_step, drafter=drafter)

    def _on_step(self, stats) -> None:
        self.steps.append(stats)
        if self.profiler is not None:
            self.profiler.on_step(stats)

    def close(self) -> None:
        self.engine.close()


def measure_workload(
    bench: BenchEngine,
    model: str,
    workload: str,
    ceilings,
    *,
    scale: float = 1.0,
    count_scale: float | None = None,
    shard: tuple[int, int] | None = None,
    load_s: float = 0.0,
    profile_dir: Path | None = None,
    before_measure=None,
    speculative: str | None = None,
    oracle_corrupt: float = 0.0,
    plain_twin: bool = False,
) -> dict:
    """Warm `bench`'s engine up on a few short requests, run `workload` on it timed, and return the
    numbers (run_throughput's dict) against `ceilings` (measured once by the caller).

    plain_twin: after a workload with constraints, also time its "plain twin" on the same engine: the
    same prompts without their constraints, each asked for exactly as many tokens as its constrained
    answer took (ignore_eos). Answers that end early (a JSON schema completed) decode fewer tokens per
    prompt than the plain workload, so only the twin isolates what the grammar costs (key
    "plain_twin")."""
    engine, cfg, steps = bench.engine, bench.cfg, bench.steps
    folder = cfg.model
    cuda = torch.cuda.is_available()
    info = engine.model_info
    wl = load_workload(workload, engine.tokenizer, info.vocab_size, engine.max_model_len, scale=scale, shard=shard,
                       count_scale=count_scale)

    if is_job_file(workload):  # a few of its own requests, short (a job file has no second seed)
        warm = [replace(r, request_id=f"warm-{r.request_id}", sampling=replace(r.sampling, max_tokens=8)) for r in wl.requests[:4]]
    else:
        warm = make_workload(workload, info.vocab_size, seed=1, scale=min(scale, 0.02)).requests[:4]
    list(engine.generate(warm))
    steps.clear()
    profile_dir = profile_dir or (Path(os.environ[PROFILE_ENV]) if os.environ.get(PROFILE_ENV) else None)
    profiler = None
    if profile_dir is not None:
        profiler = bench.profiler = StepWindowProfiler(
            profile_dir, start_step=int(os.environ.get(PROFILE_START_ENV, "60")),
            num_steps=int(os.environ.get(PROFILE_STEPS_ENV, "5")),
            decode_rows=int(os.environ[PROFILE_DECODE_ENV]) if os.environ.get(PROFILE_DECODE_ENV) else None,
        )

    jit_before = jit_snapshot()
    if before_measure is not None:
        before_measure()
    grammar0 = _grammar_counts(engine)
    results, elapsed, graphs_captured = _timed_generate(engine, wl.requests, cuda)
    if profiler is not None:
        profiler.finish()
        bench.profiler = None
    compiled = jit_compiled_since(jit_before)

    ok = [r for r in results if r.finish_reason != "error"]
    prompt_lens = [r.prompt_tokens for r in ok]
    out_lens = [r.completion_tokens for r in ok]
    total_out, total_prompt = sum(out_lens), sum(prompt_lens)

    layer_params, all_params = info.num_layer_params, info.num_params
    dtype_bytes = torch.finfo(info.dtype).bits // 8
    kv_bytes = 1 if cfg.kv_cache_dtype == "fp8_e4m3" else dtype_bytes  # per cached element
    kv_per_token = kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, kv_bytes)
    kv_capacity = engine.runner.num_blocks * cfg.block_size  # as sized by engine/kv_budget.py
    shape = dict(
        num_layers=info.num_layers,
        hidden_size=info.hidden_size,
        num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        vocab_size=info.vocab_size,
        layer_params=layer_params,
        ceilings=ceilings,
    )
    fp8 = info.quantization == "fp8"
    fp8_weight_bytes = info.weight_bytes if fp8 else load_model_info(folder, "bfloat16", "cpu", "fp8").weight_bytes
    fp8_rate = ceilings.fp8_matmul_flops_per_s

    def floor_of(weight_bytes: int, layer_rate: float | None, kv_elem_bytes: int):
        # the cache's memory holds kv_bytes / kv_elem_bytes times the tokens in another KV dtype
        return workload_floor(prompt_lens, out_lens, weight_bytes=weight_bytes, layer_flops_per_s=layer_rate,
                              dtype_bytes=kv_elem_bytes, kv_capacity_tokens=kv_capacity * kv_bytes // kv_elem_bytes, **shape)

    # The run's own floor, and two to compare with: all 16-bit (weights and KV in the model's dtype,
    # the 16-bit matrix rate) and all FP8 (FP8 projections at the measured FP8 rate, the 16-bit one
    # where the device has none; FP8 KV, a byte an element).
    floor = floor_of(info.weight_bytes, fp8_rate if fp8 else None, kv_bytes)
    floors = {"bf16": floor_of(all_params * dtype_bytes, None, dtype_bytes), "fp8": floor_of(fp8_weight_bytes, fp8_rate, 1)}
    breakdown_of = partial(
        step_breakdown,
        weight_bytes=info.weight_bytes,
        kv_bytes_per_token=kv_per_token,
        block_size=cfg.block_size,
        flops_per_token=2 * layer_params,
        lm_head_flops=2 * info.vocab_size * info.hidden_size,
        copy_bytes_per_s=ceilings.copy_bytes_per_s,
        matmul_flops_per_s=ceilings.matmul_flops_per_s,
        layer_flops_per_s=fp8_rate if fp8 else None,
        step_cost=StepCost.for_model(info, ceilings, kv_bytes),
    )
    breakdown = breakdown_of(list(steps))
    cpu_ms = [getattr(s, "schedule_ms", None) for s in steps]
    step_ms = [getattr(s, "step_ms", None) for s in steps]
    cpu_ms = [x for x in cpu_ms if x is not None]
    step_ms = [x for x in step_ms if x is not None]
    decode_steps = [s for s in steps if getattr(s, "num_prefill_tokens", 1) == 0]
    report = {
        "workload": wl.name,
        "description": wl.description,
        "model": model,
        "device": ceilings.device,
        "dtype": str(info.dtype).replace("torch.", ""),
        "quantization": info.quantization,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "kv_scales": engine.kv_scales,  # per layer (k, v) when calibrated (kv_cache_scale auto)
        "engine": {k: v for k, v in cfg.__dict__.items() if k != "model"},
        "requests": len(results),
        "errors": len(results) - len(ok),
        "prompt_tokens": total_prompt,
        "output_tokens": total_out,
        "elapsed_s": elapsed,
        "load_s": load_s,
        "requests_per_s": len(results) / elapsed,
        "output_tokens_per_s": total_out / elapsed,
        "total_tokens_per_s": (total_out + total_prompt) / elapsed,
        "ceilings": {"copy_GBps": ceilings.copy_bytes_per_s / 1e9, "matmul_TFLOPs": ceilings.matmul_flops_per_s / 1e12,
                     "fp8_matmul_TFLOPs": fp8_rate / 1e12 if fp8_rate else None},
        "floor": floor.as_dict(),
        "floor_output_tokens_per_s": total_out / floor.floor_s,
        "fraction_of_roofline": floor.floor_s / elapsed,
        "floors": {k: {**f.as_dict(), "output_tokens_per_s": total_out / f.floor_s, "fraction": f.floor_s / elapsed}
                   for k, f in floors.items()},
        "steps": len(steps),
        "decode_steps": len(decode_steps),
        "prefill_policy": cfg.prefill_policy,
        "prefill_limited_steps": sum(1 for s in steps if getattr(s, "prefill_limited", False)),
        "cpu_schedule_ms_mean": statistics.fmean(cpu_ms) if cpu_ms else None,
        "step_ms_mean": statistics.fmean(step_ms) if step_ms else None,
        "cpu_share_of_step": (sum(cpu_ms) / sum(step_ms)) if cpu_ms and step_ms and sum(step_ms) > 0 else None,
        "step_breakdown": breakdown,
        "decode_only": decode_only_rate(steps),
        "speculative": {**spec_summary(steps), "lanes": engine.verify_lanes} if cfg.speculative is not None else None,
        "speculation_gate": _gate_summary(engine),
        "grammar_masks": _grammar_masks(engine, grammar0),
        "oracle_corrupt": oracle_corrupt if speculative == "oracle" else None,
        "plain_twin": None,
        "kernels_compiled_during_run": compiled,
        "graphs_captured_during_run": graphs_captured,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if plain_twin and any(r.constraint is not None for r in wl.requests):  # last: it reuses `steps`
        # every token written, error rows' too (the twin writes them all): like for like
        written = sum(r.completion_tokens for r in results)
        report["plain_twin"] = _time_plain_twin(engine, wl.requests, results, steps, breakdown_of, written / elapsed, cuda)
    return report


def _timed_generate(engine, requests, cuda: bool) -> tuple[list, float, int]:
    """Run `requests` to the end on `engine`, timed by the wall clock until the device's last work is
    done: (results, seconds, CUDA graph sizes captured on first use meanwhile)."""
    graphs_before = graphs_captured_on_use(engine.runner)
    t0 = time.perf_counter()
    results = list(engine.generate(requests))
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return results, elapsed, graphs_captured_on_use(engine.runner) - graphs_before


def plain_twin_requests(requests, results) -> list:
    """The plain twin of a constrained workload (measure_workload): each request that wrote tokens,
    without its constraint, asked for exactly as many tokens (ignore_eos), under a new id."""
    wrote = {r.request_id: r.completion_tokens for r in results}
    return [
        replace(q, request_id=f"twin-{q.request_id}", constraint=None,
                sampling=replace(q.sampling, max_tokens=wrote[q.request_id], ignore_eos=True))
        for q in requests if wrote.get(q.request_id, 0) > 0
    ]


def _time_plain_twin(engine, requests, results, steps, breakdown_of, constrained_tok_s: float, cuda: bool) -> dict:
    """Run the plain twin timed on the same (warm) engine; its numbers and the constrained run's
    rate of tokens written (constrained_tok_s, rows that ended in an error included) as a share of the twin's."""
    twin = plain_twin_requests(requests, results)
    steps.clear()
    out, elapsed, graphs_captured = _timed_generate(engine, twin, cuda)
    tokens = sum(r.completion_tokens for r in out)
    twin_rate = tokens / elapsed
    breakdown = breakdown_of(list(steps))
    # the constrained workload once more on the same engine: every graph size it meets is captured by
    # now (the first run paid those captures, the twin did not) and the mask cache holds what the first
    # run computed, so this is the steady state of a long job
    again, again_s, again_graphs = _timed_generate(engine, requests, cuda)
    written = sum(r.completion_tokens for r in again)
    return {
        "requests": len(twin),
        "elapsed_s": elapsed,
        "output_tokens": tokens,
        "output_tokens_per_s": twin_rate,
        "constrained_share": constrained_tok_s / twin_rate,
        "graphs_captured_during_run": graphs_captured,
        "step_breakdown": breakdown,
        "constrained_again": {"elapsed_s": again_s, "output_tokens": written, "output_tokens_per_s": written / again_s,
                              "share": written / again_s / twin_rate, "graphs_captured_during_run": again_graphs},
    }


def _grammar_counts(engine: object) -> tuple[int, int, int, float]:
    g = engine.grammar
    return g.rows_computed, g.rows_copied, g.rows_cached, g.fill_s


def _grammar_masks(engine: object, before: tuple[int, int, int, float]) -> dict | None:
    """How the measured run's grammar rows got their masks (engine/grammar.py): computed by the
    library, copied within a step, or taken from the cache by state; seconds the fills ran."""
    computed, copied, cached, fill_s = (a - b for a, b in zip(_grammar_counts(engine), before))
    if not computed + copied + cached:
        return None
    kept, evicted = engine.grammar.cache_stats
    return {"computed": computed, "copied": copied, "cached": cached, "fill_s": fill_s, "kept": kept, "evicted": evicted}


def _record_oracle(cfg: EngineConfig, workload: str, scale: float, shard, spec_tokens: int, corrupt: float):
    """Run the workload plain (speculation off) and return an oracle drafter of its outputs."""
    from batchinfer.bench.oracle import oracle_drafter
    from batchinfer.engine.engine import Engine

    with Engine(replace(cfg, speculative=None)) as plain:
        wl = load_workload(workload, plain.tokenizer, plain.model_info.vocab_size, plain.max_model_len, scale=scale, shard=shard)
        truth = {r.request_id: r.output_token_ids for r in plain.generate(wl.requests)}
        vocab = plain.model_info.vocab_size
    return oracle_drafter(truth, corrupt, vocab)


def _gate_summary(engine) -> dict | None:
    """Steps the speculation gate ran with and without drafts, and its measured rates (engine/spec_gate.py)."""
    gate = engine.speculator.gate if engine.speculator is not None else None
    if gate is None:
        return None
    return {"steps": dict(gate.steps), "tokens_per_s": {str(k): v for k, v in gate.rates().items()}}














# ---- data parallel: one engine process per GPU ---------------------------------------------------


def _dp_worker(index: int, n: int, kwargs: dict, barrier, conn) -> None:
    """One engine of a data-parallel benchmark: its shard of the workload, timed from a shared barrier."""
    try:
        r = run_throughput(**kwargs, shard=(index, n), before_measure=lambda: barrier.wait(timeout=3600))
        conn.send(("ok", r))
    except BaseException as e:  # the driver reports it
        barrier.abort()
        conn.send(("error", f"{type(e).__name__}: {e}"))


def run_throughput_data_parallel(
    model: str,
    workload: str,
    n: int,
    engine_overrides: dict | None = None,
    scale: float = 1.0,
    cache_dir: Path | None = None,
) -> dict:
    """`--data-parallel N`: the workload split round-robin over N engine processes, one per GPU.

    Each process sees one GPU (CUDA_VISIBLE_DEVICES set before it starts; on CPU the cores are split),
    loads its engine, warms up, and all start the timed run together (a barrier). Aggregate throughput
    is all output tokens over the slowest engine's time; the floor is the slowest shard's roofline
    floor on its own GPU (for equal shards: the one-GPU floor rate x N).
    """
    import multiprocessing as mp

    from batchinfer.job.executors.data_parallel import visible_gpus

    if n < 1:
        raise ValueError(f"--data-parallel must be at least 1, not {n}")
    gpus = visible_gpus()
    if gpus and n > len(gpus):
        raise ValueError(f"--data-parallel {n}: only {len(gpus)} GPU(s) are visible ({', '.join(gpus)})")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    kwargs = dict(model=model, workload=workload, engine_overrides=engine_overrides, scale=scale, cache_dir=cache_dir)
    if not gpus:
        kwargs["engine_overrides"] = {**(engine_overrides or {}), "device": "cpu"}
    procs, conns = [], []
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for i in range(n):
            recv, send = ctx.Pipe(duplex=False)
            if gpus:
                os.environ["CUDA_VISIBLE_DEVICES"] = gpus[i]
            else:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            p = ctx.Process(target=_dp_worker, args=(i, n, kwargs, barrier, send), name=f"bench-dp-{i}", daemon=True)
            p.start()
            send.close()
            procs.append(p)
            conns.append(recv)
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    results, failures = [], []
    for i, (p, c) in enumerate(zip(procs, conns)):
        try:
            status, value = c.recv()
        except EOFError:
            p.join(timeout=5)
            status, value = "error", f"engine {i} died (exit code {p.exitcode})"
        p.join(timeout=30)
        (results if status == "ok" else failures).append(value)
    if failures:
        raise RuntimeError("data-parallel benchmark failed: " + "; ".join(str(f) for f in failures))
    return aggregate_data_parallel(results)


def aggregate_data_parallel(parts: list[dict]) -> dict:
    """One report for N engines that ran at the same time (see run_throughput_data_parallel)."""
    n = len(parts)
    slowest = max(parts, key=lambda r: r["elapsed_s"])
    floor_part = max(parts, key=lambda r: r["floor"]["floor_s"])
    out = sum(r["output_tokens"] for r in parts)
    prompt = sum(r["prompt_tokens"] for r in parts)
    reqs = sum(r["requests"] for r in parts)
    elapsed = slowest["elapsed_s"]
    floor_s = floor_part["floor"]["floor_s"]
    agg = dict(parts[0])
    agg.update(
        device=f"{n} x {parts[0]['device']}",
        data_parallel=n,
        requests=reqs,
        errors=sum(r["errors"] for r in parts),
        prompt_tokens=prompt,
        output_tokens=out,
        elapsed_s=elapsed,
        load_s=max(r["load_s"] for r in parts),
        requests_per_s=reqs / elapsed,
        output_tokens_per_s=out / elapsed,
        total_tokens_per_s=(out + prompt) / elapsed,
        floor=floor_part["floor"],
        floors={k: {**f, "output_tokens_per_s": out / f["floor_s"], "fraction": f["floor_s"] / elapsed}
                for k, f in (floor_part.get("floors") or {}).items()},
        floor_output_tokens_per_s=out / floor_s,
        floor_x_n_output_tokens_per_s=sum(r["floor_output_tokens_per_s"] for r in parts),
        fraction_of_roofline=floor_s / elapsed,
        steps=sum(r["steps"] for r in parts),
        decode_steps=sum(r["decode_steps"] for r in parts),
        cpu_schedule_ms_mean=None,
        step_ms_mean=None,
        cpu_share_of_step=None,
        per_engine=[{k: r[k] for k in ("device", "requests", "output_tokens", "elapsed_s", "output_tokens_per_s",
                                      "floor_output_tokens_per_s", "fraction_of_roofline")} for r in parts],
    )
    return agg

