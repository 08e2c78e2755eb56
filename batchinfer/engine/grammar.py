"""The engine's grammar work, one GrammarState per engine: compiled grammars, masks, accepts.

The engine loop (engine/engine.py) calls, per step: `accept` with the tokens it just read (one batched
call per grammar library), `start_fill` for the rows of the step being launched (the library fills on
its own threads where its fill holds no GIL, while the loop post-processes), and `bitmask` to wait for
those masks (and fill any row not started) just before sampling. The matchers live on the sequences
(Sequence.matcher); nothing here is shared between engines.

One mask per grammar state, not per row (share_masks): a matcher's state is a function of its
compiled grammar and the tokens it accepted, so every sequence carries a key of that state
(Sequence.grammar_key): one per compiled grammar at the start, and per accept step the rows that
had equal keys and took the same token get one new key (keys come from one counter and are never
reused, so rows that advance in different steps never share one). A step's fill computes one row
per distinct key and copies it into the other rows with the same key (one indexed copy after the
wait). Measured on docs1000-json (scripts/grammar_host_bench.py, greedy): of 25,600 llguidance
rows over the run 7,180 were computed, the rest copied; the rows near a string's maxLength, which cost llguidance up to ~8 ms each
(a whole-trie walk), come in groups of equal histories.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from batchinfer.engine.sequence import Sequence, SequenceStatus
from batchinfer.structured.base import Constraint, GrammarError, GrammarMatcher

MASK_BUFFERS = 3  # bitmask buffers reused round-robin (GrammarState._mask_buffer)

Verdict = str | None  # per row: None (no grammar), "ok", "rejected" or "terminated" (accepted, grammar ended)


@dataclass(frozen=True)
class StartedFill:
    """Masks of a step's sampling rows being filled while the step before is post-processed."""

    pending: Any  # structured.compiler.PendingFill
    rows: list[int]  # the sampling rows it fills (computed or copied)
    copies: tuple[list[int], list[int]] = ([], [])  # (rows, the computed row each copies)
    first: dict[int, int] = field(default_factory=dict)  # grammar key -> the row computed for it


class GrammarState:
    """Compiles constraints (cached per constraint, errors too), hands out matchers, and runs the
    per-step grammar work of one engine.

    tokenizer, vocab_size, eos_ids: the model's; backend: EngineConfig.grammar_backend;
    fill_threads: EngineConfig.grammar_threads; max_rows: the most sampling rows of a step
    (max_num_seqs); pin_memory: pin the bitmask buffers (a GPU engine: their copy to the device
    then does not wait for earlier queued work); compiler: a GrammarCompiler made elsewhere for this
    vocabulary and backend (or a Future of one), used instead of building one; share_masks: one
    mask per grammar state (module docstring), False: one per row.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, backend: str, eos_ids: Seq[int], fill_threads: int | None,
        max_rows: int, pin_memory: bool, compiler: Any = None, share_masks: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._backend = backend
        self._eos_ids = tuple(eos_ids)
        self._fill_threads = fill_threads
        self._max_rows = max_rows
        self._pin = pin_memory
        self._compiler = None  # structured.compiler.GrammarCompiler, built (or taken) with the first constraint
        self._given = compiler  # one made elsewhere for this vocabulary and backend (or a Future of it)
        self._grammars: dict[Constraint, object] = {}  # compiled grammar, or the reason it cannot be
        self._masks: list[torch.Tensor] | None = None
        self._num_masks = 0
        self._share = share_masks
        self._keys = itertools.count(1)  # grammar-state keys, never reused (Sequence.grammar_key)
        self._start_keys: dict[Constraint, int] = {}  # the key of each compiled grammar's start
        # rows filled by the library and rows given a copy, over this engine's life (benchmarks read them)
        self.rows_computed = 0
        self.rows_copied = 0
        self.fill_s = 0.0  # seconds the libraries' fills ran (PendingFill.fill_s), on any thread

    @property
    def in_use(self) -> bool:
        """Whether any constraint was ever compiled (no grammar work happens before)."""
        return self._compiler is not None

    def new_matcher(self, constraint: Constraint) -> GrammarMatcher | str:
        """A matcher at the start of the constraint's grammar, or why it cannot be compiled."""
        grammar = self._grammar(constraint)
        return grammar if isinstance(grammar, str) else grammar.new_matcher()

    def attach(self, seq: Sequence, constraint: Constraint) -> str | None:
        """Give `seq` a matcher at the start of the constraint's grammar (and its state's key), or
        say why the constraint cannot be compiled."""
        matcher = self.new_matcher(constraint)
        if isinstance(matcher, str):
            return matcher
        seq.matcher = matcher
        if not self._share:  # keys are only read to share masks: without sharing none is kept
            return None
        if constraint not in self._start_keys:
            self._start_keys[constraint] = next(self._keys)
        seq.grammar_key = self._start_keys[constraint]
        return None

    def _grammar(self, constraint: Constraint):
        if constraint not in self._grammars:
            if self._compiler is None and self._given is not None:
                given, self._given = self._given, None
                try:
                    self._compiler = given.result() if isinstance(given, Future) else given
                except Exception:  # it could not be made there: build one here (and say why per request)
                    self._compiler = None
            if self._compiler is None:
                from batchinfer.structured.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(
                    self._tokenizer, self._vocab_size, self._backend,
                    eos_ids=self._eos_ids, fill_threads=self._fill_threads,
                )
            try:
                self._grammars[constraint] = self._compiler.compile(constraint)
            except (GrammarError, ValueError) as exc:
                self._grammars[constraint] = f"constraint cannot be compiled: {exc}"
        return self._grammars[constraint]

    def accept(self, rows: list[tuple[Sequence, int]]) -> list[Verdict]:
        """Advance every grammar of `rows` (sequence, token) by its token, batched per library; the
        verdict per row."""
        verdicts: list[Verdict] = [None] * len(rows)
        at = [k for k, (seq, _) in enumerate(rows) if seq.matcher is not None]
        if not at:
            return verdicts
        matchers = [rows[k][0].matcher for k in at]
        tokens = [rows[k][1] for k in at]
        accepted = self._compiler.accept_tokens(matchers, tokens)
        step_keys: dict[tuple[int, int], int] = {}  # (key before, token) -> key after, this call only
        for k, m, token, ok in zip(at, matchers, tokens, accepted):
            verdicts[k] = ("terminated" if m.is_terminated() else "ok") if ok else "rejected"
            if not self._share:
                continue
            seq = rows[k][0]
            before = seq.grammar_key
            if before is None or verdicts[k] != "ok":
                seq.grammar_key = None
                continue
            after = step_keys.get((before, token))
            if after is None:
                after = step_keys[(before, token)] = next(self._keys)
            seq.grammar_key = after
        return verdicts

    def start_fill(
        self, sampling: list[Sequence], read: list[tuple[Sequence, int]], verdicts: list[Verdict]
    ) -> StartedFill | None:
        """Start the masks of the next step's sampling rows whose grammar goes on.

        A sequence whose token was just read (`read`, with its `verdicts`) qualifies only if its
        grammar accepted the token and has not ended; rows of sequences that still finish this step
        (stop string, length) are reset to all-allowed in bitmask(). The matchers must not be
        touched again until the fill is waited for (bitmask()).
        """
        if self._compiler is None:
            return None
        ended = {id(seq) for (seq, _), v in zip(read, verdicts) if v in ("rejected", "terminated")}
        rows = [r for r, s in enumerate(sampling)
                if s.matcher is not None and s.status is SequenceStatus.RUNNING and id(s) not in ended]
        if not rows:
            return None
        mask = self._mask_buffer(len(sampling))
        first: dict[int, int] = {}
        computed, copies = self._share_rows(sampling, rows, first)
        pending = self._compiler.start_fill([sampling[r].matcher for r in computed], mask, computed)
        return StartedFill(pending, rows, copies, first)

    def _share_rows(
        self, sampling: list[Sequence], rows: list[int], first: dict[int, int]
    ) -> tuple[list[int], tuple[list[int], list[int]]]:
        """Split `rows` into the rows to compute and (rows, source rows) to copy: a row whose
        grammar key is already in `first` (key -> row computed for it) copies that row; `first`
        gains the keys of the rows to compute."""
        if not self._share:
            self.rows_computed += len(rows)
            return rows, ([], [])
        computed: list[int] = []
        dst: list[int] = []
        src: list[int] = []
        for r in rows:
            key = sampling[r].grammar_key
            if key is None:
                computed.append(r)
                continue
            at = first.setdefault(key, r)
            if at == r:
                computed.append(r)
            else:
                dst.append(r)
                src.append(at)
        self.rows_computed += len(computed)
        self.rows_copied += len(dst)
        return computed, (dst, src)

    def bitmask(self, sampling: list[Sequence], live: list[bool], fill: StartedFill | None = None) -> torch.Tensor | None:
        """int32 CPU bitmask for the sampling rows, or None when no live row has a grammar (rows of
        finished sequences stay all-allowed: their tokens are never read).

        fill: the masks start_fill began for these rows; waited for here (always: the library may
        still be writing into its tensor)."""
        mask = fill.pending.wait() if fill is not None else None
        if fill is not None:
            self.fill_s += fill.pending.fill_s
            _copy_rows(mask, fill.copies)  # before the reset below: a stale row may be a source
        rows = [row for row, (seq, ok) in enumerate(zip(sampling, live)) if seq.matcher is not None and ok]
        if not rows:
            return None
        if mask is None:
            mask = self._mask_buffer(len(sampling))
            missing, first = rows, {}
        else:
            filled = set(fill.rows)
            stale = [r for r in fill.rows if not live[r]]
            if stale:
                mask[stale] = -1
            missing = [r for r in rows if r not in filled]
            first = {k: r for k, r in fill.first.items() if live[r]}  # a reset row is no source
        if missing:
            computed, copies = self._share_rows(sampling, missing, first)
            # one batched call per grammar library, on the library's own threads (GIL released)
            if computed:
                pending = self._compiler.start_fill([sampling[r].matcher for r in computed], mask, computed, background=False)
                pending.wait()
                self.fill_s += pending.fill_s
            _copy_rows(mask, copies)
        return mask

    def _mask_buffer(self, rows: int) -> torch.Tensor:
        """An all-allowed int32 bitmask [rows, ceil(V/32)] from a ring of MASK_BUFFERS preallocated ones.

        At most one is taken per step, for that step's sampling; the buffer taken at step N comes
        back at step N+3, after the host has read step N+2's tokens, so step N's copy of it to the
        device has finished. Allocating pinned memory every step instead cost time on the host."""
        if self._masks is None:
            from batchinfer.structured.bitmask import allocate_token_bitmask

            self._masks = [
                allocate_token_bitmask(self._max_rows, self._vocab_size, pin_memory=self._pin)
                for _ in range(MASK_BUFFERS)
            ]
        buf = self._masks[self._num_masks % MASK_BUFFERS][:rows]
        self._num_masks += 1
        return buf.fill_(-1)

    def close(self) -> None:
        """Stop the compiler's helper thread and drop the buffers and grammars (idempotent)."""
        if self._compiler is not None:
            self._compiler.close()
        self._compiler = None
        self._grammars = {}
        self._masks = None


def _copy_rows(mask: torch.Tensor, copies: tuple[list[int], list[int]]) -> None:
    """mask[dst[k]] = mask[src[k]] for every k, in one indexed copy."""
    dst, src = copies
    if dst:
        mask[torch.as_tensor(dst, dtype=torch.long)] = mask[torch.as_tensor(src, dtype=torch.long)]
