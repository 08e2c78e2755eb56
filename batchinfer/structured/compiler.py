"""The grammar module's engine-facing API: compile a constraint once, hand out matchers.

GrammarCompiler(tokenizer, vocab_size, backend="auto", cache_dir=None).compile(constraint)
returns a CompiledGrammar (from one of the backends) whose new_matcher() gives one sequence's
state. backend="auto" tries the backends in AUTO_ORDER and falls back when one cannot compile a
schema, so together they cover more schemas than any one library. Compiled forms that a library
can serialise (xgrammar, outlines-core) are cached on disk, keyed by constraint, backend, library
version and vocabulary fingerprint.

AUTO_ORDER comes from two measurements. Coverage, `bench grammar` on 200 MaskBench schemas, Qwen
151k vocabulary, this CPU: llguidance compiled 162 and passed all 162 (compile p50 6 ms); xgrammar
compiled 175, passed 173 (compile p50 0.75 s, p90 4 s); llguidance-relaxed compiled 199, passed 195;
outlines-core compiled 124, passed 114. Speed, `bench throughput --workload docs1000-json` on an
H200 (BENCHMARKS.md): xgrammar 8,166 output tok/s, llguidance 5,902, unconstrained 10,623 — in
length-bounded strings llguidance fills a 151k-token mask in ~120 µs, xgrammar in ~30 µs. But
xgrammar is not exact: it lets invalid UTF-8 byte sequences into strings (so maxLength miscounts)
and ignores maxLength next to format; those answers fail validation and become error rows. auto
keeps the exact llguidance first; `backend: xgrammar` is the faster choice where that risk is
acceptable. Every answer is validated against the full schema afterwards, whichever backend.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from batchinfer.structured.base import CompiledGrammar, Constraint, GrammarError, GrammarMatcher
from batchinfer.structured.outlines_backend import OutlinesLimits
from batchinfer.structured.vocab import Vocab, as_vocab

BACKENDS = ("llguidance", "xgrammar", "outlines")
# "llguidance-relaxed": llguidance approximating what it does not implement (oneOf as anyOf,
# unknown keywords ignored); safe because every answer is validated against the full schema.
AUTO_ORDER = ("llguidance", "xgrammar", "llguidance-relaxed", "outlines")
_PACKAGES = {"llguidance": "llguidance", "llguidance-relaxed": "llguidance", "xgrammar": "xgrammar",
             "outlines": "outlines_core"}


@dataclass(frozen=True)
class CompileLimits:
    """Limits on compiling one constraint.

    timeout_s: wall-clock limit for the in-process backends (xgrammar, llguidance); a compile that
      runs past it is abandoned (its thread finishes in the background) and the next backend tried.
    outlines: the child-process limits for outlines-core.
    auto_outlines_max_regex_chars: in auto, outlines-core is only tried when the constraint's regex
      is at most this long (complex schemas are where it takes minutes and gigabytes).
    """

    timeout_s: float = 30.0
    outlines: OutlinesLimits = field(default_factory=OutlinesLimits)
    auto_outlines_max_regex_chars: int = 1500


def backend_order(backend: str) -> tuple[str, ...]:
    """The backends `backend` stands for, in the order they are tried."""
    if backend == "auto":
        return AUTO_ORDER
    if backend not in (*BACKENDS, "llguidance-relaxed"):
        raise ValueError(f"grammar backend must be auto, {', '.join(BACKENDS)}; not {backend!r}")
    return (backend,)


def check_schema_text(constraint: Constraint) -> None:
    """Refuse constraints that are malformed before any backend sees them (message names the spot)."""
    if constraint.whitespace not in ("compact", "flexible"):
        raise GrammarError(f"whitespace must be compact or flexible, not {constraint.whitespace!r}")
    if constraint.kind == "json_schema":
        import jsonschema

        schema = constraint.schema
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object, not {type(schema).__name__}")
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            where = "/".join(str(p) for p in e.absolute_path) or "(root)"
            raise GrammarError(f"invalid JSON schema at {where}: {e.message}") from e
    elif constraint.kind == "regex":
        try:
            re.compile(constraint.value)
        except re.error as e:
            raise GrammarError(f"invalid regex {constraint.value!r}: {e}") from e
    elif constraint.kind == "choice":
        opts = constraint.options
        if not opts or not all(isinstance(o, str) for o in opts):
            raise GrammarError("choice needs a non-empty list of strings")
    else:
        raise GrammarError(f"unknown constraint kind {constraint.kind!r}; use json_schema, regex or choice")


class GrammarCompiler:
    """Compiles constraints for one tokenizer; caches compiled grammars in memory and on disk.

    tokenizer: a Hugging Face fast tokenizer, or a ready Vocab (vocab.py).
    vocab_size: the model's embedding rows (bitmask width is ceil(vocab_size/32)).
    backend: auto | llguidance | xgrammar | outlines.
    cache_dir: where serialisable compiled grammars are kept between runs (None: memory only).
    eos_ids: the ids that end an answer (default: the tokenizer's EOS).
    shared_backends: a dict of built backends to share with other compilers of the same
      vocabulary (building one for a 151k vocabulary takes about a second).
    fill_threads: threads that fill masks and accept tokens for xgrammar and llguidance (None:
      their defaults; llguidance: all CPUs but one on hosts with more than 4).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        backend: str = "auto",
        cache_dir: Path | None = None,
        *,
        eos_ids: Sequence[int] | None = None,
        limits: CompileLimits | None = None,
        shared_backends: dict[str, Any] | None = None,
        fill_threads: int | None = None,
    ) -> None:
        self.order = backend_order(backend)
        self.fill_threads = fill_threads
        self.backend = backend
        self.vocab: Vocab = as_vocab(tokenizer, vocab_size, eos_ids)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.limits = limits or CompileLimits()
        self._backends: dict[str, Any] = shared_backends if shared_backends is not None else {}
        self._memo: dict[tuple[Constraint, tuple[str, ...]], CompiledGrammar] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.last_compile_s = 0.0
        self.last_errors: list[str] = []

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def _backend(self, name: str) -> Any:
        name = "llguidance" if name == "llguidance-relaxed" else name
        b = self._backends.get(name)
        if b is None:
            if name == "llguidance":
                from batchinfer.structured.llguidance_backend import LLGuidanceBackend

                b = LLGuidanceBackend(self.vocab, threads=self.fill_threads)
            elif name == "xgrammar":
                from batchinfer.structured.xgrammar_backend import XGrammarBackend

                b = XGrammarBackend(self.vocab, fill_threads=self.fill_threads)
            else:
                from batchinfer.structured.outlines_backend import OutlinesBackend

                b = OutlinesBackend(self.vocab, self.limits.outlines)
            self._backends[name] = b
        return b

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile with the first backend that can; GrammarError naming each backend's reason otherwise."""
        key = (constraint, self.order)
        with self._lock:
            hit = self._memo.get(key)
        if hit is not None:
            return hit
        check_schema_text(constraint)
        errors: list[str] = []
        t0 = time.perf_counter()
        for name in self.order:
            try:
                compiled = self.compile_with(name, constraint, auto=len(self.order) > 1)
            except GrammarError as e:
                errors.append(f"{name}: {e}")
                continue
            self.last_compile_s = time.perf_counter() - t0
            self.last_errors = errors
            with self._lock:
                self._memo[key] = compiled
            return compiled
        self.last_compile_s = time.perf_counter() - t0
        self.last_errors = errors
        raise GrammarError(f"no grammar backend can compile this {constraint.kind} — " + " | ".join(errors))

    def compile_with(self, name: str, constraint: Constraint, auto: bool = False) -> CompiledGrammar:
        """Compile with one named backend (disk cache first where the library can serialise)."""
        backend = self._backend(name)
        if name == "outlines" and auto:
            from batchinfer.structured.outlines_backend import schema_regex

            unsupported = outlines_unsupported(constraint)
            if unsupported:
                raise GrammarError(f"skipped: outlines-core does not enforce {unsupported}")
            n = len(schema_regex(constraint))
            if n > self.limits.auto_outlines_max_regex_chars:
                raise GrammarError(f"skipped: {n}-character regex is too complex for outlines-core")
        path = self._cache_path(name, constraint)
        if path is not None and path.exists():
            try:
                return backend.deserialize(path.read_bytes(), constraint)
            except Exception:  # a stale or torn cache entry: rebuild it
                path.unlink(missing_ok=True)
        if name == "outlines":  # already limited by its child process
            compiled = backend.compile(constraint)
        elif name == "llguidance-relaxed":
            compiled = _run_with_timeout(lambda: backend.compile(constraint, relaxed=True), self.limits.timeout_s, name)
        else:
            compiled = _run_with_timeout(lambda: backend.compile(constraint), self.limits.timeout_s, name)
        if path is not None:
            _atomic_write(path, compiled.serialize())
        return compiled

    def _cache_path(self, name: str, constraint: Constraint) -> Path | None:
        if self.cache_dir is None or name.startswith("llguidance"):  # llguidance grammars are cheap to rebuild
            return None
        h = hashlib.sha256()
        for part in (constraint.kind, constraint.value, constraint.whitespace, name,
                     metadata.version(_PACKAGES[name]), self.vocab.fingerprint):
            h.update(part.encode())
            h.update(b"\0")
        return self.cache_dir / f"{name}-{h.hexdigest()[:32]}.bin"

    def fill_next_token_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, indices: Sequence[int]
    ) -> None:
        """Fill rows indices[k] of a CPU int32 bitmask for matchers[k], batching per library.

        xgrammar and llguidance fill their matchers on their own thread pools (GIL released);
        the rest row by row.
        """
        self.start_fill(matchers, bitmask, indices, background=False).wait()

    def start_fill(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, indices: Sequence[int], background: bool = True
    ) -> "PendingFill":
        """Begin filling rows indices[k] of `bitmask` for matchers[k]; PendingFill.wait() completes it.

        With background=True the libraries whose fill holds no GIL (llguidance) start at once on a
        helper thread, so the caller can keep working (the engine post-processes the other rows of
        a step meanwhile); everything else runs in wait(). Until wait() returns, the matchers must
        not be advanced and the bitmask not read.
        """
        groups: dict[str, tuple[list[Any], list[int]]] = {}
        rest: list[tuple[GrammarMatcher, int]] = []
        for m, i in zip(matchers, indices):
            name = _BATCHED.get(type(m).__name__)
            if name is None:
                rest.append((m, int(i)))
                continue
            ms, idx = groups.setdefault(name, ([], []))
            ms.append(m)
            idx.append(int(i))
        batches = [(self._backend(name), ms, idx) for name, (ms, idx) in groups.items()]
        early = [x for x in batches if background and x[0].fills_in_background]
        if not early:
            return PendingFill(bitmask, batches, rest, None, set())
        future = self._fill_thread().submit(_fill_all, early, bitmask)
        return PendingFill(bitmask, batches, rest, future, {id(b) for b, _, _ in early})

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        """accept_token(tokens[k]) for each matchers[k], batched per library; the accepted flags.

        A rejected token may leave an llguidance matcher in an error state (see its accept_tokens):
        use this where a rejection ends the sequence, as in the engine.
        """
        ok = [False] * len(matchers)
        groups: dict[str, tuple[list[Any], list[int], list[int]]] = {}
        for k, (m, t) in enumerate(zip(matchers, tokens)):
            name = _BATCHED.get(type(m).__name__)
            if name is None:
                ok[k] = bool(m.accept_token(int(t)))
                continue
            ms, ts, where = groups.setdefault(name, ([], [], []))
            ms.append(m)
            ts.append(int(t))
            where.append(k)
        for name, (ms, ts, where) in groups.items():
            for k, good in zip(where, self._backend(name).accept_tokens(ms, ts)):
                ok[k] = good
        return ok

    def _fill_thread(self) -> ThreadPoolExecutor:
        """The one helper thread that runs background fills (created on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
            return self._pool


# matcher class -> the backend whose fill_rows / finish_rows / accept_tokens batch it
_BATCHED = {"XGrammarMatcher": "xgrammar", "LLGuidanceMatcher": "llguidance"}


def _fill_all(batches: list[tuple[Any, list[Any], list[int]]], bitmask: torch.Tensor) -> None:
    """Run each backend's library fill (on the helper thread: these release the GIL)."""
    for backend, ms, idx in batches:
        backend.fill_rows(ms, bitmask, idx)


class PendingFill:
    """A bitmask fill in progress (GrammarCompiler.start_fill); wait() finishes it and returns the bitmask."""

    def __init__(self, bitmask: torch.Tensor, batches: list, rest: list, future: Future | None, started: set[int]) -> None:
        self.bitmask = bitmask
        self._batches = batches
        self._rest = rest
        self._future = future
        self._started = started
        self._done = False

    def wait(self) -> torch.Tensor:
        if self._done:
            return self.bitmask
        self._done = True
        for m, i in self._rest:
            m.fill_next_token_bitmask(self.bitmask, i)
        for backend, ms, idx in self._batches:
            if id(backend) not in self._started:
                backend.fill_rows(ms, self.bitmask, idx)
        if self._future is not None:
            self._future.result()
            self._future = None
        for backend, ms, idx in self._batches:
            backend.finish_rows(ms, self.bitmask, idx)
        return self.bitmask


# Keywords outlines-core 0.2 accepts but does not enforce (answers would fail validation later).
_OUTLINES_IGNORES = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
                     "minProperties", "maxProperties", "not", "if", "patternProperties", "dependentRequired")
_OUTLINES_FORMATS = ("date-time", "date", "time", "uuid", "uri")


def outlines_unsupported(constraint: Constraint) -> str | None:
    """The first schema keyword outlines-core would silently ignore, or None."""
    if constraint.kind != "json_schema":
        return None

    def scan(node: Any) -> str | None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in _OUTLINES_IGNORES and k != "properties":
                    return k
                if k == "format" and v not in _OUTLINES_FORMATS:
                    return f"format {v!r}"
                if k in ("properties", "$defs", "definitions") and isinstance(v, dict):
                    found = next((r for r in map(scan, v.values()) if r), None)
                else:
                    found = scan(v)
                if found:
                    return found
        elif isinstance(node, list):
            return next((r for r in map(scan, node) if r), None)
        return None

    return scan(constraint.schema)


def _run_with_timeout(fn: Any, timeout_s: float, name: str) -> Any:
    """Run fn in a daemon thread; GrammarError if it takes longer than timeout_s."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    t = threading.Thread(target=target, name=f"grammar-compile-{name}", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise GrammarError(f"{name} did not finish compiling within {timeout_s:g} s")
    if "error" in box:
        e = box["error"]
        if isinstance(e, GrammarError):
            raise e
        raise GrammarError(f"{name} failed: {type(e).__name__}: {str(e)[:300]}") from e
    return box["value"]


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def check_constraint(constraint: Constraint, tokenizer: Any, vocab_size: int | None = None, backend: str = "auto") -> None:
    """Raise GrammarError (naming the construct) when no backend can compile the constraint.

    The CLI calls this in `validate` and before `run`, so a bad schema stops the job before the GPU starts.
    """
    size = vocab_size if vocab_size is not None else (tokenizer.vocab_size if isinstance(tokenizer, Vocab) else len(tokenizer))
    GrammarCompiler(tokenizer, size, backend).compile(constraint)


def load_json_schema(value: Any, base_dir: Path | None = None) -> dict[str, Any]:
    """A job's json_schema: a dict, inline JSON text, or a path to a .json file (relative to base_dir).

    Errors name the file or say what was wrong with the inline text.
    """
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise GrammarError(f"json_schema must be an object, inline JSON text or a file path, not {type(value).__name__}")
    text = value.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"inline json_schema is not valid JSON: {e}") from e
    else:
        path = Path(text)
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        if not path.is_file():
            raise GrammarError(f"json_schema file {path} does not exist")
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise GrammarError(f"json_schema file {path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise GrammarError(f"json_schema must be a JSON object, got {type(obj).__name__}")
    return obj


def truncation_error(constraint: Constraint, text: str, max_tokens: int | None = None) -> str:
    """The error text for an answer cut at max_tokens before its grammar was complete."""
    limit = f" (max_tokens={max_tokens})" if max_tokens is not None else ""
    tail = text[-60:]
    return (
        f"answer was cut at the token limit{limit} before the {constraint.kind} was complete; "
        f"raise max_tokens. Last characters: {tail!r}"
    )
