"""llguidance behind the common grammar interface.

llguidance compiles a JSON schema in about a millisecond (it builds a lexer + Earley parser lazily,
walking the token trie at mask time), covers the most JSON-Schema features, and drops the GIL while
computing a mask. Grammars are cheap to rebuild, so nothing is cached on disk for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from operator import itemgetter
from typing import Any

import torch

from batchinfer.structured.base import Constraint, GrammarError
from batchinfer.structured.vocab import Vocab
from batchinfer.structured.xgrammar_backend import FLEXIBLE_MAX_WHITESPACE, choice_regex


class _Wrapper:
    """The duck-typed tokenizer llguidance's TokenizerWrapper reads (tokens, EOS, encode)."""

    def __init__(self, vocab: Vocab) -> None:
        self.eos_token_id = vocab.eos_id
        self.bos_token_id = None
        # Special ids get their marker bytes so llguidance can tell them apart; it never allows
        # special tokens in a grammar's text.
        self.tokens = vocab.text_bytes()
        self.special_token_ids = sorted(vocab.special_ids)
        self._encode = vocab.encode

    def __call__(self, data: bytes | str) -> list[int]:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        return self._encode(text)


class LLGuidanceMatcher:
    """One sequence's state; wraps llguidance.LLMatcher (which never raises on grammar errors)."""

    backend = "llguidance"  # relaxed grammars' matchers too: one batch per step for both

    def __init__(self, matcher: Any, eos_ids: tuple[int, ...], group: int = 0) -> None:
        self._m = matcher
        self.group = group  # which prototype it was copied from (LLGuidanceCompiled.new_matcher)
        self._eos = eos_ids
        self._main_eos = eos_ids[0]
        self._ended = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if len(self._eos) > 1:
            _mirror_eos(self, bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._ended or self._m.is_error():
            return False
        if token_id in self._eos:
            # EOS is ours to track: llguidance does not count an EOS taken in its stopped state
            # as a token, which would make rollback counts disagree with the other backends.
            if not self._m.is_accepting():
                return False
            self._ended = True
            return True
        if self._m.validate_tokens([token_id]) != 1:
            return False
        return bool(self._m.consume_token(token_id))

    def is_terminated(self) -> bool:
        return self._ended or (bool(self._m.is_stopped()) and not self._m.is_error())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    def forced_tokens(self) -> list[int]:
        if self._ended or self._m.is_error() or self._m.is_stopped():
            return []
        return [int(t) for t in self._m.compute_ff_tokens()]

    def forced_text(self) -> str:
        if self._ended or self._m.is_error() or self._m.is_stopped():
            return ""
        # a forced run may end inside a multi-byte character: keep the whole characters
        return bytes(self._m.compute_ff_bytes()).decode("utf-8", errors="ignore")

    @property
    def raw(self) -> Any:
        return self._m


def _as_int32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


class LLGuidanceCompiled:
    backend = "llguidance"

    def __init__(
        self, tokenizer: Any, grammar: str, eos_ids: tuple[int, ...], relaxed: bool = False, groups: int = 1
    ) -> None:
        self.backend = "llguidance-relaxed" if relaxed else "llguidance"
        self._tok = tokenizer
        self.grammar = grammar
        self._eos = eos_ids
        self.groups = max(1, groups)
        self._protos: list[Any] = []  # never advanced: new_matcher copies them
        self._made = 0

    def new_matcher(self) -> LLGuidanceMatcher:
        """A matcher at the grammar's start: a deep copy of one of `groups` prototypes, in turn.

        Copies of one prototype share its parser and lexer caches behind one lock: building one
        costs ~2 us instead of ~330 us (no grammar parse), and a mask another copy already computed
        a lexer state for is cheap. One lock for all rows would serialise a parallel fill, so there
        is one prototype per fill thread and fill_call hands each thread the rows of one group.
        Measured (docs schema, Qwen 151k vocabulary, 256 rows at different states, 2 threads):
        30.3 ms per fill with fresh matchers, 11.2 ms with one prototype, 4.7 ms with two."""
        import llguidance

        if not self._protos:
            self._protos = [llguidance.LLMatcher(self._tok, self.grammar, log_level=0) for _ in range(self.groups)]
        group = self._made % self.groups
        self._made += 1
        return LLGuidanceMatcher(self._protos[group].deep_copy(), self._eos, group)

    def serialize(self) -> bytes:
        raise NotImplementedError("llguidance grammars are not cached on disk (LLGuidanceBackend.library is None)")


class LLGuidanceBackend:
    """Compiles constraints with llguidance for one vocabulary (GrammarBackend).

    relaxed: the llguidance-relaxed variant (see grammar_for); base: a plain backend of the same
    vocabulary whose tokenizer and thread pool the variant shares (its matchers are batched there).
    """

    library = None  # a grammar compiles in about a millisecond: nothing is cached on disk
    # its mask fill runs in Rust with the GIL released for the whole call, so the engine may run
    # it on a background thread while the main thread keeps post-processing (see compiler.PendingFill)
    fills_in_background = True

    def __init__(
        self, vocab: Vocab, threads: int | None = None, *, relaxed: bool = False, base: "LLGuidanceBackend | None" = None
    ) -> None:
        self.name = "llguidance-relaxed" if relaxed else "llguidance"
        self.relaxed = relaxed
        if base is not None:
            self.vocab, self._threads, self._tok, self._owner = base.vocab, base._threads, base._tok, base._owner
            return
        import llguidance
        from llguidance._tokenizer import TokenizerWrapper

        self.vocab = vocab
        self._threads = threads  # fill/accept pool size; None: fill_threads()'s default
        self._tok = llguidance.LLTokenizer(TokenizerWrapper(_Wrapper(vocab)), n_vocab=vocab.vocab_size)
        self._owner = self  # the backend whose thread pool this one uses

    def grammar_for(self, constraint: Constraint, relaxed: bool = False) -> str:
        """The llguidance grammar text of a constraint.

        relaxed: approximate what llguidance does not implement (oneOf as anyOf, unknown keywords
        ignored) instead of refusing; answers are still validated against the full schema after
        decoding, so an approximation can only turn into an error row, never a wrong success.
        """
        import llguidance

        if constraint.kind == "json_schema":
            if constraint.whitespace == "flexible":
                opts: dict[str, Any] = dict(
                    whitespace_flexible=True, whitespace_pattern=rf"[\x20\x0A\x0D\x09]{{0,{FLEXIBLE_MAX_WHITESPACE}}}"
                )
            else:
                opts = dict(whitespace_flexible=False, item_separator=",", key_separator=":")
            if relaxed:
                opts.update(coerce_one_of=True, lenient=True)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(constraint.value, overrides=opts)
            except ValueError as e:
                raise GrammarError(f"llguidance cannot read the schema: {e}") from e
        if constraint.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.value)
        return llguidance.LLMatcher.grammar_from_regex(choice_regex(constraint.options))

    def supports(self, constraint: Constraint, fallback: bool = False) -> str | None:
        return None  # it says what it cannot compile when it tries (compile raises GrammarError)

    def compile(self, constraint: Constraint) -> LLGuidanceCompiled:
        import llguidance

        grammar = self.grammar_for(constraint, self.relaxed)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tok)
        if is_error:
            raise GrammarError(f"llguidance cannot compile this {constraint.kind}: {messages[0][:300]}")
        compiled = LLGuidanceCompiled(self._tok, grammar, self.vocab.eos_ids, self.relaxed, groups=self.fill_threads())
        probe = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if probe.is_error():
            raise GrammarError(f"llguidance cannot compile this {constraint.kind}: {probe.get_error()[:300]}")
        return compiled

    def deserialize(self, data: bytes, constraint: Constraint) -> LLGuidanceCompiled:
        raise NotImplementedError("llguidance grammars are not cached on disk (library is None)")

    def _pool(self) -> Any:
        """llguidance's thread pool, one per backend. llguidance's default (80% of the CPUs) leaves one
        of two cores idle while the engine waits for the fill, so: every CPU on small machines, all
        but one on larger hosts, where the engine's own thread keeps post-processing during the fill."""
        import llguidance

        owner = self._owner
        if not hasattr(owner, "_executor"):
            owner._executor = llguidance.LLExecutor(num_threads=owner.fill_threads())
        return owner._executor

    def fill_threads(self) -> int:
        """The pool's size (and so the number of matcher prototypes per grammar)."""
        if self._threads is not None:
            return self._threads
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        return cpus if cpus <= 4 else cpus - 1

    def fill_call(self, matchers: list[LLGuidanceMatcher], bitmask: torch.Tensor, indices: list[int]) -> Callable[[], None]:
        """The fill of rows indices[k] for matchers[k] on llguidance's thread pool (no EOS mirroring yet)."""
        row_bytes = bitmask.shape[1] * 4
        # rows of one prototype group next to each other: the pool splits the list into contiguous
        # runs per thread, so each thread mostly holds its own group's lock (see new_matcher)
        work = sorted(((m.group, m.raw, i) for m, i in zip(matchers, indices)), key=lambda x: x[0])
        return partial(self._pool().unsafe_compute_mask_ptr, [(raw, i) for _, raw, i in work], bitmask.data_ptr(),
                       row_bytes, bitmask.shape[0])

    def finish_rows(self, matchers: list[LLGuidanceMatcher], bitmask: torch.Tensor, indices: list[int]) -> None:
        """After the fill: allow every EOS id in the rows where llguidance allows its own."""
        by_eos: dict[tuple[int, ...], list[int]] = {}
        for m, i in zip(matchers, indices):
            if len(m._eos) > 1:
                by_eos.setdefault(m._eos, []).append(i)
        for eos, rows in by_eos.items():
            mirror_eos_rows(bitmask, rows, eos)

    def accept_tokens(self, matchers: list[LLGuidanceMatcher], tokens: list[int]) -> list[bool]:
        """accept_token for many matchers, the ordinary tokens consumed in one parallel call.

        Unlike accept_token, a rejected token may leave its matcher in an error state (llguidance's
        consume_token); callers end such a sequence anyway (the engine finishes it as an error).
        """
        ok = [False] * len(matchers)
        batch: list[tuple[int, int, Any, int]] = []  # (group, position k, raw matcher, token)
        for k, (m, t) in enumerate(zip(matchers, tokens)):
            raw = m._m
            if m._ended or raw.is_error():
                continue
            if t in m._eos:
                if raw.is_accepting():
                    m._ended = ok[k] = True
                continue
            batch.append((m.group, k, raw, t))
        if batch:
            # grouped by prototype, as in fill_call: each thread mostly takes its own group's lock
            batch.sort(key=itemgetter(0))
            done = self._pool().consume_token_par([(raw, t) for _, _, raw, t in batch])
            for (_, k, _, _), good in zip(batch, done):
                ok[k] = bool(good)
        return ok


def mirror_eos_rows(bitmask: torch.Tensor, rows: list[int], eos_ids: tuple[int, ...]) -> None:
    """llguidance knows one EOS id (eos_ids[0]); in bitmask rows where it is allowed, set the other
    EOS ids' bits too. One vectorised op per extra id over all rows (no per-row Python)."""
    idx = torch.as_tensor(rows, dtype=torch.long)
    w, b = divmod(eos_ids[0], 32)
    allowed = ((bitmask[idx, w] >> b) & 1).bool()
    for e in eos_ids[1:]:
        we, be = divmod(e, 32)
        bit = torch.tensor(_as_int32(1 << be), dtype=torch.int32)
        bitmask[idx, we] |= torch.where(allowed, bit, torch.zeros((), dtype=torch.int32))


def _mirror_eos(m: LLGuidanceMatcher, bitmask: torch.Tensor, index: int) -> None:
    """One row of mirror_eos_rows (the single-matcher fill path)."""
    mirror_eos_rows(bitmask, [index], m._eos)


__all__ = ["LLGuidanceBackend", "LLGuidanceCompiled", "LLGuidanceMatcher"]
