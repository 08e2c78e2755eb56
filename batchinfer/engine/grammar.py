"""The engine's grammar work, one GrammarState per engine: compiled grammars, masks, accepts.

The engine loop (engine/engine.py) calls, per step: `accept` with the tokens it just read (one batched
call per grammar library), `start_fill` for the rows of the step being launched (the library fills on
its own threads where its fill holds no GIL, while the loop post-processes), and `bitmask` to wait for
those masks (and fill any row not started) just before sampling. The matchers live on the sequences
(Sequence.matcher); nothing here is shared between engines.

One mask per grammar state, not per row (share_masks): a mask is a function of the grammar state,
and structured/state_keys.py gives each JSON-schema answer compiled by llguidance a key of its
state that many rows reach (inside a free string: where it opened and how many characters it
holds; completed free strings and numbers elided). A step computes one row per distinct key, the
rows with the same key copy it, and the computed masks are kept by key across steps
(engine/mask_cache.py, up to mask_cache_bytes), so a later row with a known key copies instead of
asking the library. Answers of other constraints and libraries carry their text as the key
(state_keys.TextTrack: equal texts, equal states): rows with equal texts share within a step.
Why: llguidance reuses no mask between its matchers, and inside a maxLength-bounded string every
position is a new state costing a walk of the whole token trie (~0.1-0.2 ms per row on a 151k
vocabulary, up to 3 ms near the bound).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from batchinfer.engine.mask_cache import MaskCache, copy_rows
from batchinfer.engine.sequence import Sequence, SequenceStatus
from batchinfer.structured.base import Constraint, GrammarError, GrammarMatcher
from batchinfer.structured.state_keys import SchemaKeys, TextTrack, vocab_plain_leads

MASK_BUFFERS = 3  # bitmask buffers reused round-robin (GrammarState._mask_buffer)

Verdict = str | None  # per row: None (no grammar), "ok", "rejected" or "terminated" (accepted, grammar ended)


@dataclass
class RowPlan:
    """How a step's rows get their masks: computed by the library, copied from another row of the
    step, or taken from the cache; `first` maps each key met to the row that holds its mask."""

    computed: list[int] = field(default_factory=list)
    copies: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # (rows, source rows)
    first: dict[Hashable, int] = field(default_factory=dict)
    hits: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # (rows, cache slots)
    store: tuple[list[Hashable], list[int]] = field(default_factory=lambda: ([], []))  # keys, computed rows


@dataclass(frozen=True)
class StartedFill:
    """Masks of a step's sampling rows being filled while the step before is post-processed."""

    pending: Any  # structured.compiler.PendingFill
    rows: list[int]  # the sampling rows it fills (computed or copied)
    plan: RowPlan = field(default_factory=RowPlan)


class GrammarState:
    """Compiles constraints (cached per constraint, errors too), hands out matchers, and runs the
    per-step grammar work of one engine.

    tokenizer, vocab_size, eos_ids: the model's; backend: EngineConfig.grammar_backend;
    fill_threads: EngineConfig.grammar_threads; max_rows: the most sampling rows of a step
    (max_num_seqs); pin_memory: pin the bitmask buffers (a GPU engine: their copy to the device
    then does not wait for earlier queued work); compiler: a GrammarCompiler made elsewhere for this
    vocabulary and backend (or a Future of one), used instead of building one; share_masks: one
    mask per grammar state (module docstring), False: one per row; mask_cache_bytes: how much the
    masks kept across steps may take (0: shared within a step only).
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, backend: str, eos_ids: Seq[int], fill_threads: int | None,
        max_rows: int, pin_memory: bool, compiler: Any = None, share_masks: bool = True,
        mask_cache_bytes: int = 1 << 30,
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
        self._keyers: dict[Constraint, tuple[int, SchemaKeys | None]] = {}  # (grammar id, keys) per constraint
        self._token_bytes: list[bytes] | None = None  # what each token adds to an answer's text
        self._token_leads: list[int] = []  # state_keys.plain_leads of each token's bytes (vocab_plain_leads)
        self._cache = MaskCache((vocab_size + 31) // 32, mask_cache_bytes if share_masks else 0)
        # rows filled by the library, copied from a row of their step, and taken from the cache, over
        # this engine's life (benchmarks read them)
        self.rows_computed = 0
        self.rows_copied = 0
        self.rows_cached = 0
        self.fill_s = 0.0  # seconds the libraries' fills ran (PendingFill.fill_s), on any thread

    @property
    def cache_stats(self) -> tuple[int, int]:
        """(masks kept across steps now, masks evicted to make room) of the mask cache."""
        return len(self._cache), self._cache.evicted

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
        if self._share:  # keys are only read to share masks
            gid, keys = self._keyer(constraint)
            seq.grammar_track = (gid, keys.start() if keys is not None else TextTrack())
        return None

    def _keyer(self, constraint: Constraint) -> tuple[int, SchemaKeys | None]:
        """(grammar id, SchemaKeys or None) for answers of `constraint`: SchemaKeys where its
        coarser keys apply, JSON schemas compiled by llguidance (they follow its counting rules)."""
        if constraint not in self._keyers:
            grammar = self._grammars.get(constraint)
            ok = constraint.kind == "json_schema" and getattr(grammar, "backend", None) == "llguidance"
            self._keyers[constraint] = (len(self._keyers), SchemaKeys(constraint.schema) if ok else None)
            if self._token_bytes is None:
                self._token_bytes = self._compiler.vocab.text_bytes()
                self._token_leads = vocab_plain_leads(self._token_bytes)
        return self._keyers[constraint]

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
        seqs = [rows[k][0] for k in at]
        tokens = [rows[k][1] for k in at]
        accepted = self._compiler.accept_tokens([seq.matcher for seq in seqs], tokens)
        token_bytes, leads = self._token_bytes, self._token_leads
        known = len(token_bytes) if token_bytes is not None else 0
        for k, seq, token, ok in zip(at, seqs, tokens, accepted):
            verdict = ("terminated" if seq.matcher.is_terminated() else "ok") if ok else "rejected"
            verdicts[k] = verdict
            track = seq.grammar_track
            if track is None:
                continue
            if verdict == "ok" and token < known:
                track[1].feed(token_bytes[token], leads[token])
            else:
                seq.grammar_track = None
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
        plan = self._plan(sampling, rows, {})
        mask = self._mask_buffer(len(sampling), plan)
        pending = self._compiler.start_fill([sampling[r].matcher for r in plan.computed], mask, plan.computed,
                                            before=self._gather(plan, mask))
        return StartedFill(pending, rows, plan)

    def _plan(self, sampling: list[Sequence], rows: list[int], first: dict[Hashable, int]) -> RowPlan:
        """How `rows` get their masks (RowPlan). first: keys already held by a row of this step's
        mask (key -> row)."""
        plan = RowPlan(first=first)
        if not self._share:
            plan.computed = rows
            self.rows_computed += len(rows)
            return plan
        for r in rows:
            track = sampling[r].grammar_track
            key = track[1].key() if track is not None else None
            if key is None:
                plan.computed.append(r)
                continue
            key = (track[0], key)
            at = first.get(key)
            if at is not None:
                plan.copies[0].append(r)
                plan.copies[1].append(at)
                continue
            first[key] = r
            slot = self._cache.lookup(key)
            if slot is not None:
                plan.hits[0].append(r)
                plan.hits[1].append(slot)
            else:
                plan.computed.append(r)
                if track[1].keeps:
                    plan.store[0].append(key)
                    plan.store[1].append(r)
        self.rows_computed += len(plan.computed)
        self.rows_copied += len(plan.copies[0])
        self.rows_cached += len(plan.hits[0])
        return plan

    def _gather(self, plan: RowPlan, mask: torch.Tensor) -> Callable[[], None] | None:
        """The copy of the plan's cached rows into `mask` (start_fill runs it while the library
        fills the computed rows), or None when there is none. The cache is not touched again until
        the fill is waited for (slots looked up now stay valid until then)."""
        if not plan.hits[0]:
            return None
        return lambda: self._cache.gather(plan.hits[1], mask, plan.hits[0])

    def _finish(self, mask: torch.Tensor, plan: RowPlan) -> None:
        """After the library filled plan.computed: keep the new keyed masks, copy rows within the step."""
        self._cache.store(plan.store[0], mask, plan.store[1])
        copy_rows(mask, plan.copies[0], mask, plan.copies[1])

    def bitmask(self, sampling: list[Sequence], live: list[bool], fill: StartedFill | None = None) -> torch.Tensor | None:
        """int32 CPU bitmask for the sampling rows, or None when no live row has a grammar (rows of
        finished sequences stay all-allowed: their tokens are never read).

        fill: the masks start_fill began for these rows; waited for here (always: the library may
        still be writing into its tensor)."""
        mask = fill.pending.wait() if fill is not None else None
        if fill is not None:
            self.fill_s += fill.pending.fill_s
            self._finish(mask, fill.plan)  # before the reset below: a stale row may be a source
        rows = [row for row, (seq, ok) in enumerate(zip(sampling, live)) if seq.matcher is not None and ok]
        if not rows:
            return None
        if mask is None:
            missing, first = rows, {}
        else:
            filled = set(fill.rows)
            stale = [r for r in fill.rows if not live[r]]
            if stale:
                mask[stale] = -1
            missing = [r for r in rows if r not in filled]
            first = {k: r for k, r in fill.plan.first.items() if live[r]}  # a reset row is no source
        if missing:
            plan = self._plan(sampling, missing, first)
            if mask is None:
                mask = self._mask_buffer(len(sampling), plan)
            # one batched call per grammar library, on the library's own threads (GIL released); the
            # cached rows are copied first, on this thread (background=False)
            pending = self._compiler.start_fill([sampling[r].matcher for r in plan.computed], mask, plan.computed,
                                                background=False, before=self._gather(plan, mask))
            pending.wait()
            self.fill_s += pending.fill_s
            self._finish(mask, plan)
        return mask

    def _mask_buffer(self, rows: int, plan: RowPlan) -> torch.Tensor:
        """An int32 bitmask [rows, ceil(V/32)] from a ring of MASK_BUFFERS preallocated ones, all
        allowed (-1) but for the rows the plan copies whole into it (its copies and cache hits).

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
        allow_all_but(buf, plan.copies[0] + plan.hits[0])
        return buf

    def close(self) -> None:
        """Stop the compiler's helper thread and drop the buffers and grammars (idempotent)."""
        if self._compiler is not None:
            self._compiler.close()
        self._compiler = None
        self._grammars = {}
        self._masks = None


def allow_all_but(mask: torch.Tensor, rows: list[int]) -> None:
    """Set every row of `mask` to -1 (all allowed) except `rows`, through numpy (torch's fill_ of a
    4.9 MB buffer took 8 ms on a 2-core CPU, numpy's 0.5 ms); the rows left out are about to be
    overwritten whole, most rows of a step with shared masks."""
    out = mask.numpy()
    if not rows:
        out.fill(-1)
        return
    keep = np.zeros(len(out), dtype=bool)
    keep[rows] = True
    out[np.flatnonzero(~keep)] = -1
