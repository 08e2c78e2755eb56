"""`batchinfer bench ...`: a Typer sub-app the main CLI mounts as `bench`.

`grammar`: grammar backends on MaskBench files; `throughput`: a named workload against its roofline;
`matrix`: throughput over the shape matrix in one process; `cpu`: our engine against transformers `generate` on real-text prompts on the CPU.
`job`: the whole `batchinfer run` by the wall clock against the engine alone on the same prompt ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

bench_app = typer.Typer(help="Benchmarks: grammar backends (MaskBench), throughput, the whole job.", no_args_is_help=True, rich_markup_mode=None)


@bench_app.callback()
def bench() -> None:
    """Benchmarks: grammar backends (MaskBench), throughput, the whole job."""


@bench_app.command("grammar")
def grammar(
    paths: list[Path] = typer.Argument(..., help="MaskBench .json files or folders of them."),
    backend: str = typer.Option("all", "--backend", help="all | auto | llguidance | xgrammar | outlines | llguidance-relaxed."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="HF tokenizer folder (default: Qwen's 151k vocabulary)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON summary as the last line."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Use N files, spread evenly over the sorted list."),
    compile_timeout: float = typer.Option(10.0, "--compile-timeout", help="Seconds allowed to compile one schema."),
) -> None:
    """Compile MaskBench schemas and check their instances token by token, per backend."""
    from batchinfer.bench.grammar import main

    try:
        main([str(p) for p in paths], backend, str(tokenizer) if tokenizer else None, as_json, limit, compile_timeout)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e


@bench_app.command("throughput")
def throughput(
    workload: str = typer.Option(
        "nano256", "--workload", help="nano256 | docs1000 | docs1000-json, or a job file (.yaml: its rows, prompts, sampling, schema)."
    ),
    model: str = typer.Option("qwen3-0.6b", "--model", help="A shape (qwen3-0.6b, llama-3.1-8b: random weights) or a model folder."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the numbers as JSON here (default: bench-results/)."),
    scale: float = typer.Option(1.0, "--scale", help="Shrink request counts and lengths (smoke runs on CPU)."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs"),
    max_num_batched_tokens: Optional[int] = typer.Option(None, "--max-num-batched-tokens"),
    attention_backend: Optional[str] = typer.Option(None, "--attention-backend"),
    cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs"),
    cuda_graph_max_tokens: Optional[int] = typer.Option(
        None, "--cuda-graph-max-tokens", help="Largest prefill/mixed step run as a CUDA graph (0: those run eagerly)."
    ),
    data_parallel: Optional[int] = typer.Option(None, "--data-parallel", help="Engines, one per GPU."),
    grammar_backend: Optional[str] = typer.Option(None, "--grammar-backend", help="auto | xgrammar | llguidance | outlines (docs1000-json)."),
    grammar_threads: Optional[int] = typer.Option(None, "--grammar-threads", help="Threads that fill grammar masks."),
    torch_threads: Optional[int] = typer.Option(None, "--torch-threads", help="torch's CPU threads (default: 1 on a GPU)."),
    quantization: Optional[str] = typer.Option(
        None, "--quantization", help="none | fp8: the decoder projections in FP8 (reported against the 16-bit and the FP8 floor)."
    ),
    kv_cache_dtype: Optional[str] = typer.Option(
        None, "--kv-cache-dtype", help="auto | fp8_e4m3: the KV cache in FP8 (a byte an element; reported against both floors)."
    ),
    kv_cache_scale: Optional[str] = typer.Option(
        None, "--kv-cache-scale", help="With --kv-cache-dtype fp8_e4m3: one scale for every layer, or auto (calibrated per layer at start)."
    ),
    profile_dir: Optional[Path] = typer.Option(None, "--profile-dir", help="Profile a few steps of the measured run into this folder."),
    speculative: Optional[str] = typer.Option(
        None, "--speculative", help="ngram | grammar | ngram+grammar | oracle (drafts = a recorded plain run's output)."
    ),
    spec_tokens: int = typer.Option(4, "--spec-tokens", help="Most draft tokens per sequence and step."),
    oracle_corrupt: float = typer.Option(0.0, "--oracle-corrupt", help="With --speculative oracle: share of draft tokens corrupted."),
    spec_gate: bool = typer.Option(False, "--spec-gate/--no-spec-gate",
                                   help="With --speculative: draft only where steps with drafts measure faster than plain ones."),
    spec_lanes: Optional[bool] = typer.Option(
        None, "--spec-lanes/--no-spec-lanes",
        help="With --speculative: verify steps in two lanes taking turns, or serially (default: lanes on a GPU).",
    ),
    spec_prefill_first: bool = typer.Option(
        False, "--spec-prefill-first/--spec-drafts-first",
        help="With --speculative: prompts (running ones' remaining prefill, then waiting ones) before drafts in a "
             "step's token budget (default: drafts first).",
    ),
    spec_lanes_drain: bool = typer.Option(
        True, "--spec-lanes-drain/--spec-lanes-carry-prefill",
        help="With --speculative and lanes: drain both lanes for plain steps while there is no room for drafts "
             "(the default; with --spec-prefill-first, while prefill fills the budget), or let lane steps carry that "
             "prefill without drafts.",
    ),
    plain_twin: bool = typer.Option(
        False, "--plain-twin/--no-plain-twin",
        help="With a constrained workload (docs1000-json): also time the same prompts unconstrained, each for as many tokens "
             "as its constrained answer took (what the grammar alone costs).",
    ),
    set_: Optional[list[str]] = typer.Option(
        None, "--set", help="Set an EngineConfig field (field=value, YAML value), e.g. prefill_policy=slack; repeatable."
    ),
) -> None:
    """Run a named workload; print throughput next to the workload's roofline floor on this device."""
    import logging

    from batchinfer.bench.job_workload import is_job_file
    from batchinfer.bench.report_text import format_report, write_report
    from batchinfer.bench.throughput import run_throughput
    from batchinfer.bench.workloads import WORKLOADS

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if workload not in WORKLOADS and not is_job_file(workload):
        typer.echo(f"error: unknown workload {workload!r}; choose from {', '.join(WORKLOADS)} or give a job file (.yaml)", err=True)
        raise typer.Exit(2)
    if is_job_file(workload) and (data_parallel or 1) > 1:
        typer.echo("error: a job-file --workload runs with one engine (no --data-parallel)", err=True)
        raise typer.Exit(2)
    overrides = {
        k: v
        for k, v in dict(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            attention_backend=attention_backend,
            cuda_graphs=cuda_graphs,
            cuda_graph_max_tokens=cuda_graph_max_tokens,
            grammar_backend=grammar_backend,
            grammar_threads=grammar_threads,
            torch_threads=torch_threads,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_scale=None if kv_cache_scale is None else _kv_cache_scale(kv_cache_scale),
        ).items()
        if v is not None
    }
    try:
        overrides.update(engine_sets(set_ or ()))
        if speculative is not None and data_parallel not in (None, 1):
            raise ValueError("--speculative runs with one engine (no --data-parallel)")
        if plain_twin and data_parallel not in (None, 1):
            raise ValueError("--plain-twin runs with one engine (no --data-parallel)")
        result = run_throughput(model, workload, overrides, scale=scale, data_parallel=data_parallel, profile_dir=profile_dir,
                                speculative=speculative, spec_tokens=spec_tokens, oracle_corrupt=oracle_corrupt,
                                spec_gate=spec_gate, spec_lanes=spec_lanes, spec_prefill_first=spec_prefill_first, spec_lanes_drain=spec_lanes_drain,
                                plain_twin=plain_twin)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    path = out or Path("bench-results") / f"throughput-{Path(workload).stem}-{Path(model).name}.json"
    write_report(result, path)
    typer.echo(format_report(result))
    typer.echo(f"numbers written to {path}")


@bench_app.command("matrix")
def matrix(
    shapes: Optional[str] = typer.Option(None, "--shapes", help="Comma-separated shapes or model folders (default: the whole matrix, bench/shapes.py MATRIX)."),
    workloads: str = typer.Option("nano256,docs1000", "--workloads", help="Comma-separated workloads (nano256, docs1000, docs1000-json)."),
    scale: float = typer.Option(0.25, "--scale", help="Shrink request lengths (and counts, unless --count-scale)."),
    count_scale: Optional[float] = typer.Option(None, "--count-scale", help="Shrink the request counts by this instead of --scale."),
    max_num_seqs: Optional[int] = typer.Option(None, "--max-num-seqs"),
    attention_backend: Optional[str] = typer.Option(None, "--attention-backend"),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every row's numbers as JSON here."),
    markdown_out: Optional[Path] = typer.Option(None, "--markdown", help="Write the table (as BENCHMARKS.md keeps it) here."),
) -> None:
    """`bench throughput` over the shape matrix in one process: output tok/s, % of the roofline floor and each
    step kind against its own floor, per shape x workload; one engine per shape."""
    import json
    import logging

    from batchinfer.bench.matrix import format_markdown, run_matrix
    from batchinfer.bench.shapes import MATRIX, SHAPES
    from batchinfer.bench.workloads import WORKLOADS

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    names = [x.strip() for x in shapes.split(",") if x.strip()] if shapes else list(MATRIX)
    wls = [x.strip() for x in workloads.split(",") if x.strip()]
    for n in names:
        if n not in SHAPES and not (Path(n) / "config.json").is_file():
            typer.echo(f"error: --shapes: {n!r} is neither a shape ({', '.join(SHAPES)}) nor a model folder", err=True)
            raise typer.Exit(2)
    for w in wls:
        if w not in WORKLOADS:
            typer.echo(f"error: --workloads: unknown workload {w!r}; choose from {', '.join(WORKLOADS)}", err=True)
            raise typer.Exit(2)
    overrides = {k: v for k, v in dict(max_num_seqs=max_num_seqs, attention_backend=attention_backend).items() if v is not None}

    def save(result: dict) -> None:  # after every row: a run cut short keeps what it measured
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            json_out.write_text(json.dumps(result, indent=2) + "\n")
        if markdown_out is not None:
            markdown_out.parent.mkdir(parents=True, exist_ok=True)
            markdown_out.write_text(format_markdown(result))

    try:
        result = run_matrix(names, wls, scale=scale, count_scale=count_scale, engine_overrides=overrides, log=typer.echo,
                            on_row=save)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    save(result)
    typer.echo(format_markdown(result))
    for path, what in ((json_out, "numbers"), (markdown_out, "table")):
        if path is not None:
            typer.echo(f"{what} written to {path}")


def engine_sets(assignments) -> dict:
    """`--set field=value` of bench throughput: EngineConfig fields (values parsed as YAML)."""
    import dataclasses

    from batchinfer.engine.config import EngineConfig
    from batchinfer.job.spec import parse_set

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    out = {}
    for keys, value in parse_set(list(assignments)):
        key = ".".join(keys)
        if key not in defaults:
            raise ValueError(f"--set {key}: not an EngineConfig field (one of {', '.join(sorted(defaults))})")
        kind = type(defaults[key])
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind in (bool, int, float, str) and type(value) is not kind:  # fields defaulting to None: as given
            raise ValueError(f"--set {key}={value!r}: expected {kind.__name__}")
        out[key] = value
    return out


@bench_app.command("cpu")
def cpu(
    model: Path = typer.Argument(..., help="A model folder (e.g. from `batchinfer get-model smollm2-135m-instruct PATH`)."),
    docs: Optional[Path] = typer.Option(None, "--docs", help="JSONL documents with a 'text' field (default: examples/data/invoices.jsonl)."),
    prompts: int = typer.Option(40, "--prompts", min=1, help="Chat prompts (documents and questions cycled)."),
    max_tokens: int = typer.Option(96, "--max-tokens", min=1, help="New tokens at most per prompt."),
    threads: int = typer.Option(2, "--threads", min=1, help="torch CPU threads (both sides)."),
    repeats: int = typer.Option(3, "--repeats", min=1, help="Runs of each side (order alternating)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos", help="Every row writes max_tokens (equal work on both sides)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write the numbers as JSON here."),
) -> None:
    """Our engine against transformers `generate` (one static batch) on the same real-text prompts, on the CPU."""
    import json

    from batchinfer.bench.cpu import DEFAULT_DOCS, format_cpu_report, run_cpu_bench

    if not (model / "config.json").is_file():
        typer.echo(f"error: {model} is not a model folder (no config.json)", err=True)
        raise typer.Exit(2)
    try:
        result = run_cpu_bench(str(model), docs or DEFAULT_DOCS, prompts, max_tokens, threads, repeats, ignore_eos,
                               log=lambda msg: typer.echo(msg, err=True))
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(format_cpu_report(result))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
        typer.echo(f"numbers written to {out}")
@bench_app.command("job")
def job(
    model: str = typer.Option("qwen3-0.6b", "--model", help="A shape (qwen3-0.6b, qwen2.5-1.5b, qwen2.5-7b, llama-3.1-8b: random weights) or a model folder."),
    docs: int = typer.Option(2000, "--docs", help="Documents to generate."),
    shards: int = typer.Option(4, "--shards", help="Parquet shards to spread them over."),
    min_tokens: int = typer.Option(500, "--min-tokens", help="Shortest document (tokens, approximate)."),
    max_tokens: int = typer.Option(3000, "--max-tokens", help="Longest document (tokens, approximate)."),
    max_new_tokens: int = typer.Option(200, "--max-new-tokens", help="sampling.max_tokens of the job."),
    seed: int = typer.Option(0, "--seed", help="Corpus seed (the same arguments always give the same documents)."),
    schema: bool = typer.Option(True, "--schema/--no-schema", help="Constrain answers by the benchmark's JSON schema."),
    grammar_backend: Optional[str] = typer.Option(None, "--grammar-backend", help="structured.backend of the job."),
    set_: Optional[list[str]] = typer.Option(None, "--set", help="Override a job field (key.path=value), e.g. engine.max_num_seqs=128."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Folder for the job file and its output (default: a temp folder)."),
    progress_interval: float = typer.Option(10.0, "--progress-interval", help="Seconds between the run's progress lines."),
    engine_alone: bool = typer.Option(True, "--engine-alone/--no-engine-alone", help="Also run the engine alone on the same prompt ids."),
    warm_up: bool = typer.Option(True, "--warm-up/--no-warm-up", help="Run a short job first, so the measured run finds the caches a repeat run has (bytecode, Triton kernels)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the numbers as JSON here."),
) -> None:
    """Generate Parquet shards of prose, run `batchinfer run` on them (a subprocess, by the wall clock), then the
    engine alone on the same prompt ids; print throughput, the ratio and where the run's time went."""
    import logging

    from batchinfer.bench.corpus import CorpusSpec
    from batchinfer.bench.job import JobBench, format_job_report, run_job_bench, write_json

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        bench_spec = JobBench(
            model=model, corpus=CorpusSpec(docs, shards, min_tokens, max_tokens, seed), max_new_tokens=max_new_tokens,
            schema=schema, grammar_backend=grammar_backend, overrides=tuple(set_ or ()), workdir=workdir,
            progress_interval=progress_interval, engine_alone=engine_alone, warm_up=warm_up,
        )
        result = run_job_bench(bench_spec)
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except RuntimeError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from e
    typer.echo(format_job_report(result))
    if json_out is not None:
        write_json(result, json_out)
        typer.echo(f"numbers written to {json_out}")


def _kv_cache_scale(text: str) -> float | str:
    """--kv-cache-scale: auto, or a number (EngineConfig checks it is > 0)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise typer.BadParameter(f"--kv-cache-scale must be a number or auto, not {text!r}") from None
