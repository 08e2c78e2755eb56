"""The grammar module's engine-facing API: compile a constraint once, hand out matchers, batch their work.

GrammarCompiler(tokenizer, vocab_size, backend="auto", cache_dir=None).compile(constraint)
returns a CompiledGrammar (from one of the backends, structured/registry.py) whose new_matcher()
gives one sequence's state. backend="auto" tries the backends in registry.AUTO_ORDER and falls back
when one cannot (or, asked `supports`, will not) compile a schema, so together they cover more
schemas than any one library. Each backend compiles the constraint's bounded form (structured/bounds.py:
every number fits int64/float64; answers are still validated against the schema as given). Compiled
forms of backends with a `library` are cached on disk, keyed by constraint, backend, library version
and vocabulary fingerprint.

Per step, the batch calls (fill_next_token_bitmasks, start_fill, accept_tokens) group the matchers
by the backend that made them (GrammarMatcher.backend) and make one call per library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from batchinfer.structured.base import CompiledGrammar, Constraint, GrammarBackend, GrammarError, GrammarMatcher
from batchinfer.structured.bounds import BOUNDS_VERSION, bounded_constraint
from batchinfer.structured.registry import AUTO_ORDER, BACKENDS, CompileLimits, backend_order, build_backend
from batchinfer.structured.vocab import Vocab, as_vocab

log = logging.getLogger(__name__)

__all__ = [
    "AUTO_ORDER", "BACKENDS", "CompileLimits", "GrammarCompiler", "PendingFill", "backend_order",
    "check_constraint", "check_schema_text", "truncation_error",
]


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
    backend: auto | llguidance | xgrammar | outlines | llguidance-relaxed.
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
        self.vocab: Vocab = as_vocab(tokenizer, vocab_size, eos_ids)
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.limits = limits or CompileLimits()
        self._backends: dict[str, GrammarBackend] = shared_backends if shared_backends is not None else {}
        self._memo: dict[tuple[Constraint, tuple[str, ...]], CompiledGrammar] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    def backend(self, name: str) -> GrammarBackend:
        """The built backend `name` (built on first use, registry.build_backend)."""
        return build_backend(name, self.vocab, self._backends, self.limits, self.fill_threads)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile with the first backend that can; GrammarError naming each backend's reason otherwise."""
        key = (constraint, self.order)
        with self._lock:
            hit = self._memo.get(key)
        if hit is not None:
            return hit
        check_schema_text(constraint)
        errors: list[str] = []
        for name in self.order:
            backend = self.backend(name)
            why = backend.supports(constraint, fallback=len(self.order) > 1)
            if why is not None:
                errors.append(f"{name}: skipped: {why}")
                continue
            try:
                compiled = self._compile_with(backend, constraint)
            except GrammarError as e:
                errors.append(f"{name}: {e}")
                continue
            with self._lock:
                self._memo[key] = compiled
            return compiled
        raise GrammarError(f"no grammar backend can compile this {constraint.kind} — " + " | ".join(errors))

    def _compile_with(self, backend: GrammarBackend, constraint: Constraint) -> CompiledGrammar:
        """Compile the bounded form of the constraint (structured/bounds.py) with one backend; the form
        as given when the backend cannot compile the bounded one (logged: its numbers are then unbounded)."""
        target = bounded_constraint(constraint, backend.name)
        try:
            return self._compile_one(backend, target)
        except GrammarError as e:
            if target is constraint:
                raise
            log.warning("%s cannot compile the bounded form of this schema (%s); compiling it as given, so its "
                        "numbers%s are not length-bounded", backend.name, e, " and strings" if constraint.max_string_length else "")
            return self._compile_one(backend, constraint)

    def _compile_one(self, backend: GrammarBackend, constraint: Constraint) -> CompiledGrammar:
        """Compile with one backend (disk cache first where it has one), within limits.timeout_s."""
        path = self._cache_path(backend, constraint)
        if path is not None and path.exists():
            try:
                return backend.deserialize(path.read_bytes(), constraint)
            except Exception:  # a stale or torn cache entry: rebuild it
                path.unlink(missing_ok=True)
        compiled = _run_with_timeout(lambda: backend.compile(constraint), self.limits.timeout_s, backend.name)
        if path is not None:
            _atomic_write(path, compiled.serialize())
        return compiled

    def _cache_path(self, backend: GrammarBackend, constraint: Constraint) -> Path | None:
        if self.cache_dir is None or backend.library is None:
            return None
        h = hashlib.sha256()
        for part in (constraint.kind, constraint.value, constraint.whitespace, BOUNDS_VERSION, backend.name,
                     metadata.version(backend.library), self.vocab.fingerprint):
            h.update(part.encode())
            h.update(b"\0")
        return self.cache_dir / f"{backend.name}-{h.hexdigest()[:32]}.bin"

    def _by_backend(self, matchers: Sequence[GrammarMatcher]) -> list[tuple[GrammarBackend, list[int]]]:
        """(backend, positions k of its matchers) for each backend the matchers come from, in order."""
        groups: dict[str, list[int]] = {}
        for k, m in enumerate(matchers):
            groups.setdefault(m.backend, []).append(k)
        return [(self.backend(name), ks) for name, ks in groups.items()]

    def fill_next_token_bitmasks(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, indices: Sequence[int]
    ) -> None:
        """Fill rows indices[k] of a CPU int32 bitmask for matchers[k], one batched call per library
        (xgrammar and llguidance fill on their own thread pools, GIL released)."""
        self.start_fill(matchers, bitmask, indices, background=False).wait()

    def start_fill(
        self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor, indices: Sequence[int], background: bool = True,
        before: Callable[[], None] | None = None,
    ) -> "PendingFill":
        """Begin filling rows indices[k] of `bitmask` for matchers[k]; PendingFill.wait() completes it.

        With background=True the backends whose fill holds no GIL (GrammarBackend.fills_in_background)
        start at once on a helper thread, so the caller can keep working (the engine post-processes
        the other rows of a step meanwhile); everything else runs in wait(). Until wait() returns,
        the matchers must not be advanced and the bitmask not read. before: work on other rows of
        the bitmask (such as a numpy copy of cached rows), run here on the caller's thread, after
        the early fills have started.
        """
        batches = [
            (backend, [matchers[k] for k in ks], [int(indices[k]) for k in ks])
            for backend, ks in self._by_backend(matchers)
        ]
        early = [x for x in batches if background and x[0].fills_in_background]
        if not early:
            if before is not None:
                before()
            return PendingFill(bitmask, batches, None, set())
        calls = [backend.fill_call(ms, bitmask, idx) for backend, ms, idx in early]
        entered = threading.Event()
        future = self._fill_thread().submit(_run_fills, calls, entered)
        # Hand the GIL to the helper until it is inside the library: a helper that needs the GIL
        # while this thread runs Python waits for the interpreter's switch interval (5 ms) each time
        # (the engine plans the next step meanwhile), so it needs it only to start.
        entered.wait()
        if before is not None:
            before()  # on this thread, while the library fills
        return PendingFill(bitmask, batches, future, {id(b) for b, _, _ in early})

    def accept_tokens(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]) -> list[bool]:
        """accept_token(tokens[k]) for each matchers[k], one batched call per library; the accepted flags.

        A rejected token may leave an llguidance matcher in an error state (see its accept_tokens):
        use this where a rejection ends the sequence, as in the engine.
        """
        ok = [False] * len(matchers)
        for backend, ks in self._by_backend(matchers):
            accepted = backend.accept_tokens([matchers[k] for k in ks], [int(tokens[k]) for k in ks])
            for k, good in zip(ks, accepted):
                ok[k] = bool(good)
        return ok

    def _fill_thread(self) -> ThreadPoolExecutor:
        """The one helper thread that runs background fills (created on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-fill")
            return self._pool

    def close(self) -> None:
        """Stop the helper thread (after the fill it may be running); idempotent."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _fill_all(batches: list[tuple[Any, list[Any], list[int]]], bitmask: torch.Tensor) -> float:
    """Each backend's library fill, on this thread; the seconds it took."""
    return _run_fills([backend.fill_call(ms, bitmask, idx) for backend, ms, idx in batches])


def _run_fills(calls: list[Callable[[], None]], entered: threading.Event | None = None) -> float:
    """Run prepared library fills (GrammarBackend.fill_call), after setting `entered`; the seconds they took."""
    if entered is not None:
        entered.set()
    t = time.perf_counter()
    for call in calls:
        call()
    return time.perf_counter() - t


class PendingFill:
    """A bitmask fill in progress (GrammarCompiler.start_fill); wait() finishes it and returns the bitmask.

    fill_s: after wait(), the seconds the libraries' fills ran (on the helper thread and in wait()),
    whether or not the caller waited for them."""

    def __init__(self, bitmask: torch.Tensor, batches: list, future: Future | None, started: set[int]) -> None:
        self.bitmask = bitmask
        self._batches = batches
        self._future = future
        self._started = started
        self._done = False
        self.fill_s = 0.0

    def wait(self) -> torch.Tensor:
        if self._done:
            return self.bitmask
        self._done = True
        self.fill_s = _fill_all([b for b in self._batches if id(b[0]) not in self._started], self.bitmask)
        if self._future is not None:
            self.fill_s += self._future.result()
            self._future = None
        for backend, ms, idx in self._batches:
            backend.finish_rows(ms, self.bitmask, idx)
        return self.bitmask


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


def truncation_error(constraint: Constraint, text: str, max_tokens: int | None = None) -> str:
    """The error text for an answer cut at max_tokens before its grammar was complete."""
    limit = f" (max_tokens={max_tokens})" if max_tokens is not None else ""
    tail = text[-60:]
    return (
        f"answer was cut at the token limit{limit} before the {constraint.kind} was complete; "
        f"raise max_tokens. Last characters: {tail!r}"
    )
