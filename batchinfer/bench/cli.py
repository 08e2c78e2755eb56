"""`batchinfer bench ...`: a Typer sub-app the main CLI mounts as `bench`.

`grammar` is here; the GPU `throughput` command joins it later.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

bench_app = typer.Typer(help="Benchmarks: grammar backends (MaskBench), throughput.", no_args_is_help=True)


@bench_app.callback()
def bench() -> None:
    """Benchmarks: grammar backends (MaskBench), throughput."""


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
