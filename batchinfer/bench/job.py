"""`batchinfer bench job`: the whole job, by the wall clock, against the engine alone on the same prompt ids.

1. Parquet shards of English-like prose (corpus.py; deterministic, cached by their arguments);
2. a job file with a JSON schema over them;
3. first, unless --no-warm-up, a short run of the same job (WARM_UP_DOCS documents) in its own
   folder: it fills the caches a machine keeps between runs (Python's bytecode, Triton's compiled
   kernels and launchers), so the measured run starts as a user's second and later runs do (cron,
   Airflow); its start-up is reported as the first run's ("cold");
4. the real `batchinfer run` in a subprocess (`python -m batchinfer.cli run ... --log-token-ids
   --log-format json`), timed from before the process starts to after it exits;
5. the engine alone (this process) on the prompt ids the run logged (`_token_ids/`), in input order,
   with the job's sampling and schema, after a short warm-up: what the same engine does with none
   of the job around it;
6. the numbers: wall throughput (output tok/s, docs/s), run / engine-alone, and where the run's wall
   clock went, from the phase timestamps the run itself recorded (job/phases.py; `_report.json`
   and its last log line): imports, model load, KV cache, graph capture, the preflight threads
   (input scan and id check, tokenizer, grammar compile), first engine step, generation, part
   commit, report writing, exit.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from batchinfer.bench.corpus import CorpusSpec, write_corpus
from batchinfer.bench.workloads import DOCS_SCHEMA
from batchinfer.io.layout import report_json_path

log = logging.getLogger(__name__)

SYSTEM = "You read business documents and describe each one as JSON."
TEMPLATE = (
    "Title: {{ title }}\n\n{{ text }}\n\n"
    "Describe this document as JSON: its title, a summary, its language, its number of pages and up to 8 topics."
)


@dataclass(frozen=True)
class JobBench:
    """What `bench job` runs: a model (shape name or folder), a corpus, the job's output length and overrides."""

    model: str = "qwen3-0.6b"
    corpus: CorpusSpec = field(default_factory=CorpusSpec)
    max_new_tokens: int = 200
    schema: bool = True
    grammar_backend: str | None = None
    overrides: tuple[str, ...] = ()  # --set key.path=value for the job (and so for the engine alone)
    workdir: Path | None = None
    progress_interval: float = 10.0
    engine_alone: bool = True
    warm_up: bool = True  # a short run first, so the measured one finds the on-disk caches (module docstring)


WARM_UP_DOCS = 32


def _model_folder(model: str, cache: Path) -> tuple[Path, str]:
    """(folder, load_format): a shape gets a folder with its config and tokenizer (random weights)."""
    from batchinfer.bench.shapes import SHAPES, write_shape

    if model in SHAPES:
        return write_shape(model, cache / model), "random"
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"--model {model!r}: not a bench shape ({', '.join(SHAPES)}) nor a model folder")
    return path, "safetensors"


def check_vocab_fits(folder: Path) -> None:
    """A text job needs every id its tokenizer makes to be a row of the model's embedding: say so if not."""
    from batchinfer.models.loader import load_model_info, load_tokenizer

    n_tok, n_vocab = len(load_tokenizer(folder)), load_model_info(str(folder)).vocab_size
    if n_tok > n_vocab:
        raise ValueError(
            f"{folder}: its tokenizer has {n_tok:,} tokens but the model embeds only {n_vocab:,}; a text job "
            "cannot run on it (give the folder a tokenizer that fits)"
        )


def write_job(bench: JobBench, folder: Path, load_format: str, shards: list[Path], work: Path) -> Path:
    """The job file (YAML) of the benchmark; returns its path."""
    import yaml

    job: dict[str, Any] = {
        "model": {"path": str(folder.resolve()), "dtype": "auto"},
        "input": {"path": str(shards[0].parent.resolve() / "shard-*.parquet"), "id_column": "doc_id"},
        "output": {"path": str((work / "out").resolve()), "keep_columns": ["title"]},
        "prompt": {"system": SYSTEM, "template": TEMPLATE},
        "sampling": {"max_tokens": bench.max_new_tokens, "temperature": 0.0},
        "engine": {"load_format": load_format},
    }
    if bench.schema:
        schema = work / "schema.json"
        schema.write_text(json.dumps(DOCS_SCHEMA, indent=2))
        job["structured"] = {"json_schema": str(schema.resolve())}
        if bench.grammar_backend:
            job["structured"]["backend"] = bench.grammar_backend
    path = work / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def run_cli(job: Path, bench: JobBench, log_path: Path) -> dict[str, Any]:
    """`batchinfer run` in a subprocess: wall time, exit code, its phases and progress lines (JSON log lines)."""
    cmd = [sys.executable, "-m", "batchinfer.cli", "run", str(job), "--overwrite", "--log-token-ids",
           "--log-format", "json", "--progress-interval", str(bench.progress_interval), "--max-error-rate", "1"]
    for o in bench.overrides:
        cmd += ["--set", o]
    phases: dict[str, Any] | None = None
    progress: list[dict[str, Any]] = []
    summary_line = ""
    t0, t0_unix = time.perf_counter(), time.time()
    with open(log_path, "w", encoding="utf-8") as keep:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
        assert proc.stderr is not None and proc.stdout is not None
        for line in proc.stderr:
            keep.write(line)
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if not isinstance(obj, dict):
                sys.stderr.write(line)
                continue
            if obj.get("event") == "phases":
                phases = obj
            elif obj.get("event") == "summary":
                summary_line = obj["message"].splitlines()[0]
            elif obj.get("event") == "progress":
                progress.append(obj)
                print(f"  [run] {obj['message']}", file=sys.stderr, flush=True)
            elif obj.get("level") in ("warning", "error"):
                print(f"  [run] {obj['level']}: {obj['message']}", file=sys.stderr, flush=True)
        stdout = proc.stdout.read()
        code = proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        tail = log_path.read_text(encoding="utf-8").splitlines()[-20:]
        raise RuntimeError(f"batchinfer run exited with {code}:\n" + stdout + "\n".join(tail))
    return {"command": cmd, "wall_s": wall, "started_unix": t0_unix, "exit_code": code, "stdout": stdout.strip(),
            "summary_line": summary_line, "phases": phases, "progress": progress}


def _input_order(job: Path, overrides: tuple[str, ...]) -> list[str]:
    """The ids in the order the run reads them (files in listing order, rows in file order)."""
    import polars as pl

    from batchinfer.io.readers import list_input_files
    from batchinfer.job.spec import load_job

    spec = load_job(job, list(overrides))
    ids: list[str] = []
    for f in list_input_files(spec.input.path, spec.input.format):
        ids += pl.read_parquet(f.path, columns=[spec.input.id_column])[spec.input.id_column].cast(pl.Utf8).to_list()
    return ids


def run_engine_alone(job: Path, out_dir: Path, overrides: tuple[str, ...]) -> dict[str, Any]:
    """The job's engine on the run's own prompt ids (in input order), with the job's sampling and constraint."""
    import torch

    from batchinfer.engine.engine import Engine
    from batchinfer.engine.request import Request
    from batchinfer.job.spec import load_job
    from batchinfer.observe import read_token_ids

    spec = load_job(job, list(overrides))
    logged = read_token_ids(out_dir)
    prompts = dict(zip(logged["id"].to_list(), logged["prompt_token_ids"].to_list()))
    order = [i for i in _input_order(job, overrides) if i in prompts]
    if not order:
        raise RuntimeError(f"{out_dir}: the run logged no prompt token ids")
    sampling = spec.sampling.to_params()
    constraint = spec.structured.constraint() if spec.structured is not None else None
    requests = [Request(f"r{k}", list(prompts[i]), sampling, constraint) for k, i in enumerate(order)]
    t = time.perf_counter()
    engine = Engine(spec.engine_config())
    load_s = time.perf_counter() - t
    warm = replace(sampling, max_tokens=min(8, sampling.max_tokens))
    list(engine.generate([Request(f"warm{k}", r.prompt_token_ids[:512], warm, constraint) for k, r in enumerate(requests[:4])]))
    t = time.perf_counter()
    results = list(engine.generate(requests))
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t
    out_tokens = sum(r.completion_tokens for r in results)
    prompt_tokens = sum(r.prompt_tokens for r in results)
    return {
        "requests": len(results),
        "errors": sum(r.finish_reason == "error" for r in results),
        "load_s": load_s,
        "elapsed_s": elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / elapsed,
        "docs_per_s": len(results) / elapsed,
    }


def _span_totals(phases: dict[str, Any]) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in phases.get("spans", []):
        out[s["name"]] = out.get(s["name"], 0.0) + s["s"]
    return out


def _gap(phases: dict[str, Any], first: str, then: str) -> float | None:
    """Seconds from the start of span `first` to the start of span `then` (None unless both are there)."""
    starts = {s["name"]: s["start_s"] for s in phases.get("spans", [])}
    return starts[then] - starts[first] if first in starts and then in starts else None


def breakdown(phases: dict[str, Any], wall_s: float, started_unix: float | None = None) -> dict[str, Any]:
    """Where the run's wall clock went, from its own phase record (seconds; `..._at`: since the command started).

    started_unix: when the command was started (wall clock); the run's own times are lined up with it
    through its phases' origin_unix (else they count from the process's start as the OS reports it)."""
    raw = phases.get("marks", {})
    shift = phases["origin_unix"] - started_unix if started_unix is not None and "origin_unix" in phases else 0.0
    marks = {k: v + shift for k, v in raw.items()}  # since the command started
    spans = _span_totals(phases)
    first_step = marks.get("first_step")
    startup = {
        "interpreter_start": marks.get("cli_loaded"),
        "imports": (marks["imports_done"] - marks["cli_loaded"]) if {"imports_done", "cli_loaded"} <= marks.keys() else None,
        "job_spec": spans.get("load_job"),
        "plan_main_thread": spans.get("plan"),
        "input_scan_and_id_check": spans.get("input_scan"),
        "tokenizer_load": spans.get("tokenizer"),
        "grammar_compile": spans.get("grammar_compile"),
        "engine_start": spans.get("engine_start"),
        # the engine's import, and the main thread waiting for the GIL while a preflight thread holds it
        "engine_before_model_load": _gap(phases, "engine_start", "engine.model_load"),
        "model_load": spans.get("engine.model_load"),
        "compile_key_wait": spans.get("engine.compile_key_wait"),
        "kv_cache_profile_and_alloc": spans.get("engine.kv_cache"),
        "graph_capture": (spans.get("engine.graph_capture_decode", 0.0) + spans.get("engine.graph_capture_mixed", 0.0)) or None,
        "graph_capture_decode": spans.get("engine.graph_capture_decode"),
        "graph_capture_mixed": spans.get("engine.graph_capture_mixed"),
        "sampling_warm_up": spans.get("engine.sampling_warm_up"),
        "engine_waits_for_tokenizer": spans.get("engine.tokenizer"),
        "waits_for_preflight": spans.get("preflight_wait"),
        "engine_ready_at": marks.get("engine_ready"),
        "first_step_at": first_step,
        "engine_ready_to_first_step": (first_step - marks["engine_ready"]) if first_step and "engine_ready" in marks else None,
    }
    teardown = {
        "generation": (marks["last_row_done"] - first_step) if first_step and "last_row_done" in marks else None,
        "last_row_to_parts_committed": (marks["parts_committed"] - marks["last_row_done"])
        if {"parts_committed", "last_row_done"} <= marks.keys() else None,
        "summary_printed_at": marks.get("summary"),
        "report_writing": spans.get("report"),
        "exit": (wall_s - marks["exit"]) if "exit" in marks else None,
    }
    model_load = spans.get("engine.model_load")
    to_first = first_step
    return {
        "startup": startup,
        "teardown": teardown,
        "command_to_first_step_s": to_first,
        "model_load_s": model_load,
        "first_step_within_model_load_plus_5s": (to_first <= model_load + 5.0) if to_first is not None and model_load is not None else None,
        "spans": phases.get("spans", []),
        "marks": marks,
        "marks_shift_s": shift,  # added to the run's own times (spans are as it recorded them)
    }


def run_job_bench(bench: JobBench) -> dict[str, Any]:
    """Run the benchmark (see the module docstring); returns its numbers."""
    cache = Path(tempfile.gettempdir()) / "batchinfer-bench"
    work = Path(bench.workdir) if bench.workdir is not None else cache / f"job-{Path(bench.model).name}"
    work.mkdir(parents=True, exist_ok=True)
    folder, load_format = _model_folder(bench.model, cache)
    check_vocab_fits(folder)
    t = time.perf_counter()
    shards = write_corpus(bench.corpus, cache / f"corpus-{bench.corpus.key()}")
    corpus_s = time.perf_counter() - t
    job = write_job(bench, folder, load_format, shards, work)
    cold = _warm_up(bench, folder, load_format, cache, work / "warm-up") if bench.warm_up else None
    print(f"bench job: {bench.corpus.docs} docs in {bench.corpus.shards} shards ({corpus_s:.1f}s to make or find), "
          f"model {bench.model}; running `batchinfer run {job}` ...", file=sys.stderr, flush=True)
    run = run_cli(job, bench, work / "run-stderr.log")
    report = json.loads(report_json_path(work / "out").read_text())
    summary = (report.get("run") or {}).get("summary") or {}
    phases = run["phases"] or summary.get("phases") or {}
    rows, out_tokens, prompt_tokens = summary.get("this_run_rows", 0), summary.get("completion_tokens", 0), summary.get("prompt_tokens", 0)
    wall = run["wall_s"]
    result: dict[str, Any] = {
        "bench": "job",
        "model": bench.model,
        "corpus": asdict(bench.corpus),
        "max_new_tokens": bench.max_new_tokens,
        "schema": bench.schema,
        "overrides": list(bench.overrides),
        "job_file": str(job),
        "run": {
            "wall_s": wall,
            "rows": rows,
            "errors": summary.get("this_run_errors"),
            "prompt_tokens": prompt_tokens,
            "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall,
            "total_tokens_per_s": (out_tokens + prompt_tokens) / wall,
            "docs_per_s": rows / wall,
            "generation_s": summary.get("seconds"),
            "engine_s": (report.get("throughput") or {}).get("engine_s"),
            "summary_line": run["summary_line"],
            "progress_lines": len(run["progress"]),
        },
        "breakdown": breakdown(phases, wall, run["started_unix"]),
        "warm_up": cold,
    }
    if bench.engine_alone:
        print("bench job: the engine alone on the run's prompt ids ...", file=sys.stderr, flush=True)
        alone = run_engine_alone(job, work / "out", bench.overrides)
        result["engine_alone"] = alone
        r = result["run"]
        result["ratio"] = {
            "output_tokens_per_s": r["output_tokens_per_s"] / alone["output_tokens_per_s"] if alone["output_tokens_per_s"] else None,
            "total_tokens_per_s": r["total_tokens_per_s"] / alone["total_tokens_per_s"] if alone["total_tokens_per_s"] else None,
            "wall_vs_engine_elapsed": alone["elapsed_s"] / wall,
            "engine_in_run_vs_alone": (alone["elapsed_s"] / r["engine_s"]) if r.get("engine_s") else None,
        }
    result["env"] = env_note()
    result["versions"] = report.get("versions")
    result["device"] = (report.get("versions") or {}).get("gpu", "cpu")
    return result


def _warm_up(bench: JobBench, folder: Path, load_format: str, cache: Path, work: Path) -> dict[str, Any]:
    """The short first run (module docstring, step 3): its wall time and start-up, from cold caches
    where this machine had none."""
    corpus = replace(bench.corpus, docs=min(WARM_UP_DOCS, bench.corpus.docs), shards=1)
    work.mkdir(parents=True, exist_ok=True)
    shards = write_corpus(corpus, cache / f"corpus-{corpus.key()}")
    job = write_job(bench, folder, load_format, shards, work)
    print(f"bench job: warm-up run ({corpus.docs} docs) ...", file=sys.stderr, flush=True)
    run = run_cli(job, bench, work / "run-stderr.log")
    b = breakdown(run["phases"] or {}, run["wall_s"], run["started_unix"])
    return {"docs": corpus.docs, "wall_s": run["wall_s"], "command_to_first_step_s": b["command_to_first_step_s"],
            "startup": b["startup"]}


def _f(x: Any, spec: str = ".2f", unit: str = "s") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"


def format_job_report(r: dict[str, Any]) -> str:
    """The numbers as lines for people."""
    run, b = r["run"], r["breakdown"]
    c = r["corpus"]
    lines = [
        f"bench job: model {r['model']} on {r['device']}; {c['docs']} docs ({c['min_tokens']}-{c['max_tokens']} tokens, "
        f"{c['shards']} shards), max_tokens {r['max_new_tokens']}, {'JSON schema' if r['schema'] else 'no schema'}",
        f"run (wall, process start to exit): {run['wall_s']:.2f}s for {run['rows']} rows ({run['errors']} errors): "
        f"{run['output_tokens_per_s']:,.0f} output tok/s, {run['total_tokens_per_s']:,.0f} total tok/s, {run['docs_per_s']:.2f} docs/s",
        f"  inside it: generation (engine ready to last part) {_f(run['generation_s'])}, engine steps {_f(run['engine_s'])}",
    ]
    alone = r.get("engine_alone")
    if alone:
        ratio = r["ratio"]
        lines += [
            f"engine alone (same prompt ids, sampling, schema): {alone['elapsed_s']:.2f}s: "
            f"{alone['output_tokens_per_s']:,.0f} output tok/s, {alone['total_tokens_per_s']:,.0f} total tok/s, "
            f"{alone['docs_per_s']:.2f} docs/s (load {alone['load_s']:.1f}s, not counted)",
            f"run / engine alone: {100 * (ratio['output_tokens_per_s'] or 0):.1f}% of the output tok/s, "
            f"{100 * (ratio['total_tokens_per_s'] or 0):.1f}% of the total tok/s; "
            f"engine inside the run vs alone: {100 * (ratio['engine_in_run_vs_alone'] or 0):.1f}%",
        ]
    s, t = b["startup"], b["teardown"]
    lines += [
        f"command to first engine step: {_f(b['command_to_first_step_s'])} (model load {_f(b['model_load_s'])}; "
        f"target <= model load + 5 s: {'met' if b['first_step_within_model_load_plus_5s'] else 'NOT met'})",
        "start-up (main thread unless marked):",
        f"  interpreter start {_f(s['interpreter_start'])}, imports {_f(s['imports'])}, job spec {_f(s['job_spec'])}, "
        f"plan {_f(s['plan_main_thread'])}",
        f"  engine start {_f(s['engine_start'])} = before the model load {_f(s.get('engine_before_model_load'))} "
        f"(engine import; the GIL held by preflight threads) + model load {_f(s['model_load'])} + waiting for Triton's "
        f"cache key {_f(s.get('compile_key_wait'))} + KV cache (profiling) "
        f"{_f(s['kv_cache_profile_and_alloc'])} + graph capture {_f(s['graph_capture'])} (decode {_f(s['graph_capture_decode'])}, "
        f"mixed {_f(s['graph_capture_mixed'])}) + sampling warm-up {_f(s['sampling_warm_up'])} + waiting for the tokenizer "
        f"{_f(s['engine_waits_for_tokenizer'])}",
        f"  [threads, during the engine start] input scan and id check {_f(s['input_scan_and_id_check'])}, tokenizer load "
        f"{_f(s['tokenizer_load'])}, grammar compile {_f(s['grammar_compile'])}; then waiting for them {_f(s['waits_for_preflight'])}",
        f"  engine ready at {_f(s['engine_ready_at'])}, first step done at {_f(s['first_step_at'])} "
        f"(+{_f(s['engine_ready_to_first_step'])}: first rows rendered and tokenised, first step)",
        *([f"  the warm-up run before it ({r['warm_up']['docs']} docs, this machine's caches as they were): command to first "
           f"step {_f(r['warm_up']['command_to_first_step_s'])}, engine start {_f(r['warm_up']['startup']['engine_start'])}, "
           f"imports {_f(r['warm_up']['startup']['imports'])}"] if r.get("warm_up") else []),
        "teardown:",
        f"  generation {_f(t['generation'])}; last row to parts committed {_f(t['last_row_to_parts_committed'])}; "
        f"summary printed at {_f(t['summary_printed_at'])}; report writing {_f(t['report_writing'])}; exit {_f(t['exit'])}",
    ]
    return "\n".join(lines)


def write_json(r: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(r, indent=2, default=str))


def env_note() -> str:
    """The variables that change what the run does (recorded with the numbers)."""
    keys = ("CUDA_VISIBLE_DEVICES", "TOKENIZERS_PARALLELISM", "BATCHINFER_PROFILE_DIR")
    return ", ".join(f"{k}={os.environ[k]}" for k in keys if k in os.environ)
