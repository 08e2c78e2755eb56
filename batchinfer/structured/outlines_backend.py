"""outlines-core behind the common grammar interface.

outlines-core converts the constraint to one regex and precomputes a token-level automaton
(an Index). Building it is the expensive part (minutes and gigabytes for a nested schema on a
151k vocabulary), so it always runs in a child process with a time and memory limit
(see _outlines_worker.py). Once built, the allowed tokens depend only on the automaton state, so
each state's bitmask row is computed once and cached on the compiled grammar: a mask fill is a
row copy. The Index pickles, which the compiler's disk cache stores.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchinfer.structured.base import Constraint, GrammarError
from batchinfer.structured.bounds import bounded_regex
from batchinfer.structured.vocab import Vocab
from batchinfer.structured.xgrammar_backend import FLEXIBLE_MAX_WHITESPACE, choice_regex


@dataclass(frozen=True)
class OutlinesLimits:
    """Bounds on building one Index: wall-clock seconds, child address space, regex length.

    max_regex_chars: a cheap proxy for automaton size; longer regexes are refused without trying
    (the schemas that took minutes and 10 GB all produced long regexes).
    fallback_max_regex_chars: as a fallback (backend auto) outlines-core is only tried when the
    constraint's regex is at most this long (complex schemas are where it takes minutes and gigabytes).
    """

    timeout_s: float = 20.0
    memory_bytes: int = 3 << 30
    max_regex_chars: int = 4000
    fallback_max_regex_chars: int = 1500


# Keywords outlines-core 0.2 accepts but does not enforce (answers would fail validation later).
_IGNORED_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "uniqueItems",
                     "minProperties", "maxProperties", "not", "if", "patternProperties", "dependentRequired")
_FORMATS = ("date-time", "date", "time", "uuid", "uri")


def outlines_unsupported(constraint: Constraint) -> str | None:
    """The first schema keyword outlines-core would silently ignore, or None."""
    if constraint.kind != "json_schema":
        return None

    def scan(node: Any) -> str | None:
        if isinstance(node, dict):
            for k, v in node.items():
                if k in _IGNORED_KEYWORDS and k != "properties":
                    return k
                if k == "format" and v not in _FORMATS:
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


def schema_regex(constraint: Constraint) -> str:
    """The regex outlines-core matches for a constraint (JSON schemas converted by outlines-core, with
    bounded number patterns: see structured/bounds.py)."""
    if constraint.kind == "regex":
        return constraint.value
    if constraint.kind == "choice":
        return choice_regex(constraint.options)
    from outlines_core import json_schema

    ws = rf"[ \n\t]{{0,{FLEXIBLE_MAX_WHITESPACE}}}" if constraint.whitespace == "flexible" else ""
    try:
        return bounded_regex(json_schema.build_regex_from_schema(constraint.value, ws))  # numbers bounded (bounds.py)
    except Exception as e:  # outlines-core raises a ValueError-like error naming the construct
        raise GrammarError(f"outlines-core cannot convert the schema to a regex: {str(e)[:300]}") from e


class OutlinesMatcher:
    """One sequence: a stack of automaton states (so rollback is popping)."""

    backend = "outlines"

    def __init__(self, compiled: "OutlinesCompiled") -> None:
        self._g = compiled
        self._states = [compiled.index.get_initial_state()]
        self._ended = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        bitmask[index].copy_(self._g.row(self._states[-1]))

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._ended:
            return False
        state = self._states[-1]
        if token_id in self._g.eos_ids:
            if not self._g.index.is_final_state(state):
                return False
            self._ended = True
            return True
        if token_id not in self._g.normal_ids:
            return False
        nxt = self._g.index.get_next_state(state, token_id)
        if nxt is None:
            return False
        self._states.append(nxt)
        return True

    def is_terminated(self) -> bool:
        return self._ended

    def forced_tokens(self) -> list[int]:
        return []  # the token-level automaton has no forced-string query

    def forced_text(self) -> str:
        return ""

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens >= len(self._states):
            raise RuntimeError(f"cannot roll back {num_tokens} tokens: only {len(self._states) - 1} accepted")
        if num_tokens:
            del self._states[-num_tokens:]


class OutlinesCompiled:
    backend = "outlines"

    def __init__(self, index: Any, vocab: Vocab) -> None:
        self.index = index
        self.eos_ids = frozenset(vocab.eos_ids)
        self.normal_ids = _NormalIds(vocab)
        self._vocab_size = vocab.vocab_size
        self._eos = vocab.eos_ids
        self._rows: dict[int, torch.Tensor] = {}

    def row(self, state: int) -> torch.Tensor:
        """The bitmask row of an automaton state (computed once per state, then reused)."""
        row = self._rows.get(state)
        if row is None:
            allowed = np.zeros(((self._vocab_size + 31) // 32) * 32, dtype=np.uint8)
            ids = [i for i in self.index.get_allowed_tokens(state) if i < self._vocab_size]
            allowed[ids] = 1
            allowed[list(self._eos)] = 1 if self.index.is_final_state(state) else 0
            packed = np.packbits(allowed, bitorder="little").view(np.int32)
            row = torch.from_numpy(packed.copy())
            self._rows[state] = row
        return row

    def new_matcher(self) -> OutlinesMatcher:
        return OutlinesMatcher(self)

    def serialize(self) -> bytes:
        return pickle.dumps(self.index)


class _NormalIds:
    """Membership test for ids that spell text (cheap: no set of 151k ints per grammar)."""

    def __init__(self, vocab: Vocab) -> None:
        self._vocab = vocab

    def __contains__(self, token_id: int) -> bool:
        return 0 <= token_id < self._vocab.vocab_size and self._vocab.is_normal(token_id)


class OutlinesBackend:
    """Compiles constraints with outlines-core for one vocabulary, in a limited child process (GrammarBackend)."""

    name = "outlines"
    library = "outlines_core"  # the Index pickles: the disk cache keeps it
    fills_in_background = False  # a fill is a row copy per matcher, in Python

    def __init__(self, vocab: Vocab, limits: OutlinesLimits = OutlinesLimits()) -> None:
        import outlines_core

        self.vocab = vocab
        self.limits = limits
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab.token_bytes):
            if vocab.is_normal(i):
                by_bytes.setdefault(b, []).append(i)
        self._vocabulary = outlines_core.Vocabulary(vocab.eos_id, by_bytes)

    def supports(self, constraint: Constraint, fallback: bool = False) -> str | None:
        """As a fallback, outlines-core steps aside where it would not enforce a keyword of the schema
        or its regex is past limits.fallback_max_regex_chars."""
        if not fallback:
            return None
        unsupported = outlines_unsupported(constraint)
        if unsupported:
            return f"outlines-core does not enforce {unsupported}"
        try:
            n = len(schema_regex(constraint))
        except GrammarError as e:
            return str(e)
        if n > self.limits.fallback_max_regex_chars:
            return f"{n}-character regex is too complex for outlines-core"
        return None

    def compile(self, constraint: Constraint) -> OutlinesCompiled:
        regex = schema_regex(constraint)
        if len(regex) > self.limits.max_regex_chars:
            raise GrammarError(
                f"outlines-core: the {constraint.kind} becomes a {len(regex)}-character regex "
                f"(limit {self.limits.max_regex_chars}); too complex to build its automaton"
            )
        payload = pickle.dumps((regex, self._vocabulary, self.limits.memory_bytes))
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "batchinfer.structured._outlines_worker"],
                input=payload,
                capture_output=True,
                timeout=self.limits.timeout_s,
            )
        except subprocess.TimeoutExpired as e:
            raise GrammarError(
                f"outlines-core did not finish building the automaton within {self.limits.timeout_s:g} s"
            ) from e
        if proc.returncode != 0:
            why = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            msg = why[-1][:300] if why else f"exit status {proc.returncode}"
            if "MemoryError" in msg or "memory" in msg.lower() or proc.returncode < 0:
                msg = f"ran past its {self.limits.memory_bytes >> 20} MiB memory limit ({msg})"
            raise GrammarError(f"outlines-core cannot compile this {constraint.kind}: {msg}")
        return OutlinesCompiled(pickle.loads(proc.stdout), self.vocab)

    def deserialize(self, data: bytes, constraint: Constraint) -> OutlinesCompiled:
        return OutlinesCompiled(pickle.loads(data), self.vocab)

    def fill_call(self, matchers: list[OutlinesMatcher], bitmask: torch.Tensor, indices: list[int]) -> Callable[[], None]:
        """Row by row: each row is a copy of the state's cached mask row."""

        def fill() -> None:
            for m, i in zip(matchers, indices):
                m.fill_next_token_bitmask(bitmask, i)

        return fill

    def finish_rows(self, matchers: list[OutlinesMatcher], bitmask: torch.Tensor, indices: list[int]) -> None:
        """Nothing to correct: a cached row already holds the EOS bits."""

    def accept_tokens(self, matchers: list[OutlinesMatcher], tokens: list[int]) -> list[bool]:
        return [m.accept_token(t) for m, t in zip(matchers, tokens)]


__all__ = ["OutlinesBackend", "OutlinesCompiled", "OutlinesLimits", "OutlinesMatcher", "outlines_unsupported", "schema_regex"]
