"""The engine's grammar work, one GrammarState per engine: compiled grammars, masks, accepts.

The engine loop (engine/engine.py) calls, per step: `accept` with the tokens it just read (one batched
call per grammar library), `start_fill` for the rows of the step being launched (the library fills on
its own threads where its fill holds no GIL, while the loop post-processes), and `bitmask` to wait for
those masks (and fill any row not started) just before sampling. The matchers live on the sequences
(Sequence.matcher); nothing here is shared between engines.

One mask per grammar state, not per row (share_masks): a mask is a function of the grammar state,
and structured/state_keys.py gives each JSON-schema answer compiled by llguidance a key of its
state that many rows reach (inside a free string: where it opened and how many characters it
holds; completed free strings and numbers elided). A step computes one mask per distinct key into
its table (StepTable), the rows with the same key point at it (the sampler gets RowMasks: the
distinct masks and a row index, gathered on its device), and the computed masks are kept by key
across steps (engine/mask_cache.py, up to mask_cache_bytes), so a later row with a known key takes
a copy instead of asking the library. Answers of other constraints and libraries carry their text
as the key (state_keys.TextTrack: equal texts, equal states): rows with equal texts share a mask
within a step.
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

import torch

from batchinfer.engine.mask_cache import MaskCache
from batchinfer.engine.sequence import Sequence, SequenceStatus
from batchinfer.structured.base import Constraint, GrammarError, GrammarMatcher
from batchinfer.structured.bitmask import RowMasks
from batchinfer.structured.state_keys import SchemaKeys, TextTrack, vocab_plain_leads

MASK_BUFFERS = 3  # step tables reused round-robin (GrammarState._step_table)

Verdict = str | None  # per row: None (no grammar), "ok", "rejected" or "terminated" (accepted, grammar ended)


class StepTable:
    """One step's masks as distinct rows and a row index (structured/bitmask.RowMasks): slot 0 of the
    table is all-allowed and never written, slots 1.. are handed out in order, one per distinct mask of
    the step; index[r] is the slot of sampling row r (0 for rows without a grammar, or whose sequence
    ended after its fill started). Pinned on a GPU engine, so their copies to the device are async."""

    def __init__(self, rows: int, words: int, pin: bool) -> None:
        self.table = torch.empty((rows + 1, words), dtype=torch.int32, pin_memory=pin)
        self.table[0] = -1
        self._index = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        self.index = self._index.numpy()  # a view: writes land in the pinned tensor
        self.used = 1
        self.rows = 0

    def reset(self, rows: int) -> "StepTable":
        """Start a step of `rows` sampling rows: no slot handed out, every row all-allowed."""
        self.used = 1
        self.rows = rows
        self.index[:rows] = 0
        return self

    def new_slot(self) -> int:
        self.used += 1
        return self.used - 1

    def take(self) -> RowMasks:
        """The step's masks: the slots handed out and the index of its rows (views, not copies)."""
        return RowMasks(self.table[: self.used], self._index[: self.rows])


@dataclass
class RowPlan:
    """How a step's rows get their table slots: a new slot the library fills (computed), the slot of
    another row of the step with the same key (shared), or a new slot the cache's copy of the key's
    mask goes to (hits). first maps each key met to its slot."""

    computed: list[int] = field(default_factory=list)  # rows the library fills
    slots: list[int] = field(default_factory=list)  # their table slots
    first: dict[Hashable, int] = field(default_factory=dict)
    hits: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))  # (cache slots, table slots)
    store: tuple[list[Hashable], list[int]] = field(default_factory=lambda: ([], []))  # (keys, table slots)


@dataclass(frozen=True)
class StartedFill:
    """Masks of a step's sampling rows being filled while the step before is post-processed."""

    pending: Any  # structured.compiler.PendingFill
    rows: list[int]  # the sampling rows it gave a slot (computed, shared or cached)
    table: StepTable
    plan: RowPlan = field(default_factory=RowPlan)


class GrammarState:
    """Compiles constraints (cached per constraint, errors too), hands out matchers, and runs the
    per-step grammar work of one engine.

    tokenizer, vocab_size, eos_ids: the model's; backend: EngineConfig.grammar_backend;
    fill_threads: EngineConfig.grammar_threads; max_rows: the most sampling rows of a step
    (max_num_seqs); pin_memory: pin the step tables (a GPU engine: their copy to the device
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
        self._tables: list[StepTable] = []  # MASK_BUFFERS of them, made on first use
        self._num_steps = 0
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
        self, sampling: list[Sequence], read: list[tuple[Sequence, int]], verdicts: list[Verdict],
        wanted: list[bool] | None = None,
    ) -> StartedFill | None:
        """Start the masks of the next step's sampling rows whose grammar goes on.

        A sequence whose token was just read (`read`, with its `verdicts`) qualifies only if its
        grammar accepted the token and has not ended; rows of sequences that still finish this step
        (stop string, length) are reset to all-allowed in bitmask(). wanted: per row, whether it
        needs this fill at all (None: every row). The matchers must not be touched again until the
        fill is waited for (bitmask()).
        """
        if self._compiler is None:
            return None
        ended = {id(seq) for (seq, _), v in zip(read, verdicts) if v in ("rejected", "terminated")}
        rows = [r for r, s in enumerate(sampling)
                if s.matcher is not None and s.status is SequenceStatus.RUNNING and id(s) not in ended
                and (wanted is None or wanted[r])]
        if not rows:
            return None
        table = self._step_table(len(sampling))
        plan = self._plan(sampling, rows, {}, table)
        pending = self._compiler.start_fill([sampling[r].matcher for r in plan.computed], table.table, plan.slots,
                                            before=self._gather(plan, table))
        return StartedFill(pending, rows, table, plan)

    def _plan(self, sampling: list[Sequence], rows: list[int], first: dict[Hashable, int], table: StepTable) -> RowPlan:
        """Give each of `rows` its slot of `table` (RowPlan). first: keys already given a slot in
        this step (key -> slot)."""
        plan = RowPlan(first=first)
        slot_of: list[int] = []  # slot per row of `rows`
        if not self._share:
            plan.computed = rows
            plan.slots = slot_of = [table.new_slot() for _ in rows]
        else:
            for r in rows:
                track = sampling[r].grammar_track
                key = track[1].key() if track is not None else None
                if key is not None:
                    key = (track[0], key)
                    slot = first.get(key)
                    if slot is not None:
                        slot_of.append(slot)
                        continue
                slot = table.new_slot()
                slot_of.append(slot)
                if key is None:
                    plan.computed.append(r)
                    plan.slots.append(slot)
                    continue
                first[key] = slot
                kept = self._cache.lookup(key)
                if kept is not None:
                    plan.hits[0].append(kept)
                    plan.hits[1].append(slot)
                else:
                    plan.computed.append(r)
                    plan.slots.append(slot)
                    if track[1].keeps:
                        plan.store[0].append(key)
                        plan.store[1].append(slot)
        table.index[rows] = slot_of
        self.rows_computed += len(plan.computed)
        self.rows_cached += len(plan.hits[0])
        self.rows_copied += len(rows) - len(plan.computed) - len(plan.hits[0])
        return plan

    def _gather(self, plan: RowPlan, table: StepTable) -> Callable[[], None] | None:
        """The copy of the plan's cached masks into their table slots (start_fill runs it while the
        library fills the computed ones), or None when there is none. The cache is not touched again
        until the fill is waited for (slots looked up now stay valid until then)."""
        if not plan.hits[0]:
            return None
        return lambda: self._cache.gather(plan.hits[0], table.table, plan.hits[1])

    def bitmask(self, sampling: list[Sequence], live: list[bool], fill: StartedFill | None = None) -> RowMasks | None:
        """The sampling rows' masks (RowMasks), or None when no live row has a grammar (rows of
        finished sequences stay all-allowed: their tokens are never read).

        fill: the masks start_fill began for these rows; waited for here (always: the library may
        still be writing into its table)."""
        if fill is not None:
            fill.pending.wait()
            self.fill_s += fill.pending.fill_s
            self._cache.store(fill.plan.store[0], fill.table.table, fill.plan.store[1])
        rows = [row for row, (seq, ok) in enumerate(zip(sampling, live)) if seq.matcher is not None and ok]
        if not rows:
            return None
        if fill is None:
            table, missing, first = self._step_table(len(sampling)), rows, {}
        else:
            table, first = fill.table, fill.plan.first  # a slot stays right for its key, live row or not
            stale = [r for r in fill.rows if not live[r]]
            if stale:
                table.index[stale] = 0
            filled = set(fill.rows)
            missing = [r for r in rows if r not in filled]
        if missing:
            plan = self._plan(sampling, missing, first, table)
            # one batched call per grammar library, on the library's own threads (GIL released); the
            # cached masks are copied first, on this thread (background=False)
            pending = self._compiler.start_fill([sampling[r].matcher for r in plan.computed], table.table, plan.slots,
                                                background=False, before=self._gather(plan, table))
            pending.wait()
            self.fill_s += pending.fill_s
            self._cache.store(plan.store[0], table.table, plan.store[1])
        return table.take()

    def _step_table(self, rows: int) -> StepTable:
        """The next of a ring of MASK_BUFFERS step tables, reset for a step of `rows` sampling rows.

        One is taken per step, for that step's sampling; the table taken at step N comes back at
        step N+3, after the host has read step N+2's tokens, so step N's copies of it to the device
        have finished. Allocating pinned memory every step instead cost time on the host."""
        if not self._tables:
            words = (self._vocab_size + 31) // 32
            self._tables = [StepTable(self._max_rows, words, self._pin) for _ in range(MASK_BUFFERS)]
        table = self._tables[self._num_steps % MASK_BUFFERS]
        self._num_steps += 1
        return table.reset(rows)

    @property
    def pin_memory(self) -> bool:
        """Whether mask tables go to the device from pinned memory (a GPU engine)."""
        return self._pin

    def close(self) -> None:
        """Stop the compiler's helper thread and drop the buffers and grammars (idempotent)."""
        if self._compiler is not None:
            self._compiler.close()
        self._compiler = None
        self._grammars = {}
        self._tables = []

