"""Continuous batching: which sequences run in the next step, and how many tokens each computes.

One step mixes decodes and prefill chunks. Decodes are counted against the token budget first, so
a long document is prefilled in chunks and never stalls sequences that are decoding. KV blocks
are handed out oldest-first; when they run out, the newest sequence is preempted (its blocks are
freed and it goes back to the front of the waiting queue to be recomputed later).

Sequences flagged `final_pending` (their in-flight token is their last) are never scheduled: the
engine finishes them as soon as it reads that token.

Admission reserves the blocks a sequence will need while it decodes (prompt + max_tokens, the
output part capped), not just its prompt, so preemption stays rare.

Identical prompts (a job's n answers of one row): a waiting sequence whose whole shareable prefix is
being prefilled right now by a running sequence waits (sequences behind it are admitted meanwhile)
until those blocks are computed and published, then shares them: n answers prefill their prompt once.
Blocks are only published after the step that computes them, so admitted together they would all
compute it. A prompt that shares only part of its prefix (a common system prompt) is never held back.

How many prefill tokens a step takes once its decodes are placed is the prefill policy's call
(engine/prefill_policy.py, by name: `budget` all the budget left, `slack` what the decode step absorbs).

Lanes (speculative verify steps, engine/lanes.py): `schedule(lane)` plans a step of the running
sequences of one lane only (Sequence.lane), while the other lane's step may be in flight with its
drafts appended. The sequences it admits join that lane (up to half of max_num_seqs per lane, and
about half of what waits, so the lanes stay even); only sequences of that lane are preempted (a
sequence in flight is never touched). `schedule()` plans every running sequence.

A step with drafts puts its one-token rows first (_singles_first), where the attention backend's
decode kernel takes them; other steps keep running order (decodes already come first).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchinfer.engine.kv_cache import BlockAllocator, hash_block
from batchinfer.engine.prefill_policy import BudgetPolicy, PrefillPolicy, StepView
from batchinfer.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """max_reserved_output: most output tokens counted per sequence at admission (the cap)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_sharing: bool = True
    max_reserved_output: int = 1024


@dataclass
class ScheduledStep:
    """The work of one step: seqs[i] computes num_tokens[i] tokens; samples[i] if that ends its tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0  # one per decoding sequence
    num_draft_tokens: int = 0  # the drafts those sequences verify (speculative decoding)
    num_context_tokens: int = 0  # KV positions its attention covers: each sequence's tokens through its last new one
    prefill_limited: bool = False  # the prefill policy gave less than the budget left

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens + self.num_draft_tokens


def _decodes(seq: Sequence, n: int) -> bool:
    """Whether `n` tokens of seq in a step are a decode (its next token and its drafts), not prefill."""
    return seq.num_computed_tokens >= seq.num_prompt_tokens and n == 1 + seq.num_draft


def _singles_first(step: ScheduledStep) -> None:
    """Order a step with drafts: one-token rows first, then decodes with their drafts, then prefill
    chunks, each group in running order. The attention backend gives the step's leading one-token
    rows to the split-K decode kernel and the rest to the extend kernel, one program per sequence
    and KV head over its whole context (attention/triton_backend.py); in running order a drafted
    sequence among undrafted ones cut the leading run short, so grammar drafts, a few sequences a
    step, sent most of a step's plain decodes to the extend kernel."""
    def group(i: int) -> int:
        n = step.num_tokens[i]
        return 0 if n == 1 else 1 if _decodes(step.seqs[i], n) else 2

    order = sorted(range(len(step.seqs)), key=group)
    if order != list(range(len(order))):
        step.seqs = [step.seqs[i] for i in order]
        step.num_tokens = [step.num_tokens[i] for i in order]
        step.samples = [step.samples[i] for i in order]


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, allocator: BlockAllocator, policy: PrefillPolicy | None = None
    ) -> None:
        self.config = config
        self.policy = policy or BudgetPolicy()
        self.num_steps = 0  # schedule() calls so far
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # oldest admission first
        self._lane: int | None = None  # the lane the schedule() under way plans (None: all)
        self.num_preemptions = 0

    def check(self, seq: Sequence) -> str | None:
        """Why this request can never run, or None. The engine turns a message into an error result."""
        total = seq.num_prompt_tokens + seq.max_tokens
        if seq.num_prompt_tokens == 0:
            return "the prompt is empty"
        if total > self.config.max_model_len:
            return (
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.max_tokens}) = {total} "
                f"is over max_model_len {self.config.max_model_len}"
            )
        blocks = self._blocks(total)
        if blocks > self.allocator.num_blocks:
            return (
                f"prompt + max_tokens = {total} tokens needs {blocks} KV blocks, "
                f"the whole cache has {self.allocator.num_blocks}"
            )
        return None

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def running_in(self, lane: int | None) -> list[Sequence]:
        """The running sequences of a lane (None: all), oldest admission first (a new list)."""
        return list(self.running) if lane is None else [s for s in self.running if s.lane == lane]

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence and free its blocks.

        Usually it is running; with overlap it may have been preempted (sent back to waiting, its
        blocks already freed) while the step that sampled its last token was still in flight.
        """
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
            self._release(seq)
        seq.status = SequenceStatus.FINISHED

    # --- one step -------------------------------------------------------------------------

    def schedule(self, lane: int | None = None) -> ScheduledStep:
        """The next step: every running sequence's work, or (lane given) only that lane's (module docstring)."""
        step = ScheduledStep()
        self.num_steps += 1
        self._lane = lane
        budget = self.config.max_num_batched_tokens
        view = self._view(budget)
        # the policy is asked only when some prefill could run (a prefilling sequence, or a free slot
        # and a sequence waiting for it)
        prefill_budget = self.policy.prefill_tokens(view) if view.budget and view.idle_slots else view.budget
        step.prefill_limited = prefill_budget < view.budget
        for seq in self._mine():
            if seq.status is not SequenceStatus.RUNNING or seq.final_pending or step.total_tokens >= budget:
                continue
            is_decode = seq.num_remaining == 1 + seq.num_draft
            # a decode with drafts (speculative decoding) verifies them all, as far as the budget goes
            want = min(seq.num_remaining, budget - step.total_tokens) if is_decode else min(seq.num_remaining, prefill_budget)
            if want == 0:
                continue
            n = self._fit(seq, want, step)
            if n:
                prefill_budget -= 0 if is_decode else n
                self._add_to_step(step, seq, n)
        if not step.preempted:
            room = budget - step.total_tokens
            self._admit(step, min(room, prefill_budget) if step.prefill_limited else room)
        if step.num_draft_tokens:
            _singles_first(step)
        return step

    def _view(self, budget: int) -> StepView:
        """The step as the prefill policy sees it before any prefill is placed (StepView)."""
        decode_rows = decode_context = prefilling = active = 0
        prefill_context, oldest = -1, self.num_steps
        for s in self._mine():
            if s.final_pending:
                continue
            active += 1
            if s.num_remaining == 1 + s.num_draft:
                decode_rows += 1 + s.num_draft
                decode_context += s.num_tokens
            else:
                prefilling += 1
                oldest = min(oldest, s.admitted_step)
                if prefill_context < 0:
                    prefill_context = s.num_computed_tokens
        free = max(0, self._seat_limit() - active)
        return StepView(
            budget=max(0, budget - decode_rows),
            decode_rows=decode_rows,
            decode_context=decode_context,
            prefill_context=max(0, prefill_context),
            idle_slots=prefilling + min(free, len(self.waiting)),
            oldest_wait=self.num_steps - oldest,
        )

    def complete_step(self, step: ScheduledStep) -> None:
        """After the forward: advance computed counts and publish newly full blocks for sharing.

        Sequences that finished meanwhile (overlap: their row in this step is wasted work) are skipped.
        Call it only when every token this step computes is known on the host (block hashes read them).
        """
        for seq, n in zip(step.seqs, step.num_tokens):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens += n
            if self.config.enable_prefix_sharing:
                self._register_full_blocks(seq)

    # --- helpers --------------------------------------------------------------------------

    def _seat_limit(self) -> int:
        """The most running sequences this schedule() may hold: max_num_seqs, or a lane's half of it
        (lane 0 the larger half, as Lanes splits the running sequences) and never more than the
        other lane leaves of max_num_seqs (plain steps between lane episodes admit into lane 0 up to
        max_num_seqs, so the other lane may hold more than its half)."""
        lane, most = self._lane, self.config.max_num_seqs
        if lane is None:
            return most
        other = sum(1 for s in self.running if s.lane != lane and not s.final_pending)
        return min((most + 1 - lane) // 2, most - other)

    def _mine(self) -> list[Sequence]:
        """The running sequences this schedule() plans (all, or the lane's)."""
        return self.running_in(self._lane)

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _reserved_blocks(self, seq: Sequence) -> int:
        """Blocks this sequence is expected to hold at most (output part capped)."""
        out = min(seq.max_tokens - seq.num_generated, self.config.max_reserved_output)
        return self._blocks(min(seq.num_tokens + out, self.config.max_model_len))

    def _add_to_step(self, step: ScheduledStep, seq: Sequence, n: int) -> None:
        if seq.num_draft and seq.num_computed_tokens + n < seq.num_tokens:
            seq.drop_drafts(seq.num_tokens - seq.num_computed_tokens - n)  # drafts the budget/blocks cannot take
        step.seqs.append(seq)
        step.num_tokens.append(n)
        step.samples.append(seq.num_computed_tokens + n == seq.num_tokens)
        step.num_context_tokens += seq.num_computed_tokens + n
        if _decodes(seq, n):
            step.num_decode_tokens += 1
            step.num_draft_tokens += seq.num_draft
        else:
            step.num_prefill_tokens += n

    def _fit(self, seq: Sequence, want: int, step: ScheduledStep) -> int:
        """Give seq blocks for up to `want` tokens, preempting newer sequences if none are free.

        Returns how many tokens it can compute; 0 if it was preempted itself.
        """
        if seq.num_computed_tokens + want <= len(seq.block_ids) * self.block_size:
            return want  # fits the blocks it holds (most decode steps)
        while True:
            room = (len(seq.block_ids) + self.allocator.num_free) * self.block_size - seq.num_computed_tokens
            if room >= 1:
                break
            newer = self.running[self.running.index(seq) + 1 :]
            if self._lane is not None:
                newer = [s for s in newer if s.lane == self._lane]
            victim = newer[-1] if newer else seq
            self._preempt(victim, step)
            if victim is seq:
                return 0
        n = min(want, room)
        need = self._blocks(seq.num_computed_tokens + n) - len(seq.block_ids)
        if need > 0:
            seq.block_ids.extend(self.allocator.allocate(need))
        return n

    def _preempt(self, seq: Sequence, step: ScheduledStep) -> None:
        seq.drop_drafts()
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq)

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(reversed(seq.block_ids))
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _admit(self, step: ScheduledStep, budget: int) -> None:
        if not self.waiting:
            return
        held: list[Sequence] = []  # waiting for a running sequence to publish their prompt's blocks
        try:
            self._admit_waiting(step, budget, held)
        finally:
            self.waiting.extendleft(reversed(held))  # back at the front, in their order

    def _admit_waiting(self, step: ScheduledStep, budget: int, held: list[Sequence]) -> None:
        # A final_pending sequence is done as soon as its token is read: its slot is free already
        # (it is never scheduled again, so steps still hold at most max_num_seqs rows).
        active = sum(1 for s in self._mine() if not s.final_pending)
        limit = self._seat_limit()
        if self._lane is not None:  # keep the lanes even: this one takes about half of what waits
            other = sum(1 for s in self.running if s.lane != self._lane and not s.final_pending)
            limit = min(limit, active + max(0, -(-(other + len(self.waiting) - active) // 2)))
        if budget <= 0 or active >= limit:
            return  # nothing can be admitted (a full decode step while prompts wait): skip the block count
        outstanding = sum(max(0, self._reserved_blocks(s) - len(s.block_ids)) for s in self.running)
        in_progress = self._prefixes_in_progress() if self.config.enable_prefix_sharing else set()
        while self.waiting and budget > 0 and active < limit:
            seq = self.waiting[0]
            shared = self._match_prefix(seq) if self.config.enable_prefix_sharing else []
            whole = self._whole_prefix(seq)
            if whole is not None and len(shared) < whole[0] and whole[1] in in_progress:
                held.append(self.waiting.popleft())
                continue
            need = self._reserved_blocks(seq) - len(shared)
            spare = self.allocator.num_free - outstanding - need
            if self.running and spare < 0:  # its reservation does not fit next to the running ones
                break
            if self.allocator.num_free == 0:
                break
            self.waiting.popleft()
            for b in shared:
                self.allocator.share(b)
            seq.block_ids = list(shared)
            seq.num_computed_tokens = len(shared) * self.block_size
            seq.num_registered_blocks = len(shared)
            seq.status = SequenceStatus.RUNNING
            seq.admitted_step = self.num_steps
            if self._lane is not None:
                seq.lane = self._lane
            self.running.append(seq)
            active += 1
            n = self._fit(seq, min(seq.num_remaining, budget), step)
            outstanding += max(0, self._reserved_blocks(seq) - len(seq.block_ids))
            self._add_to_step(step, seq, n)
            budget -= n
            if whole is not None and len(shared) < whole[0]:
                in_progress.add(whole[1])

    def _full_block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Chained hashes of the first num_blocks full blocks, extending the cached list."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs : (i + 1) * bs]))
        return hashes[:num_blocks]

    def _whole_prefix(self, seq: Sequence) -> tuple[int, bytes] | None:
        """(blocks, hash) of the prompt's whole shareable prefix (every full block before its last
        token); None for a prompt shorter than two blocks' worth. Only prompt tokens are hashed."""
        blocks = (seq.num_prompt_tokens - 1) // self.block_size
        if blocks == 0:
            return None
        if len(seq.block_hashes) < blocks:
            self._full_block_hashes(seq, blocks)
        return blocks, seq.block_hashes[blocks - 1]

    def _prefixes_in_progress(self) -> set[bytes]:
        """Whole-prefix hashes of the running sequences whose prompt blocks are not all published yet
        (a decoding sequence has published them: only the few still prefilling are hashed)."""
        out = set()
        for s in self.running:
            if s.num_registered_blocks < (s.num_prompt_tokens - 1) // self.block_size:
                out.add(self._whole_prefix(s)[1])  # type: ignore[index]
        return out

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Blocks in use that hold this sequence's leading full blocks; the last token is never
        covered, so the step still computes it and gets logits."""
        max_blocks = (seq.num_tokens - 1) // self.block_size
        shared: list[int] = []
        for h in self._full_block_hashes(seq, max_blocks):
            b = self.allocator.lookup(h)
            if b is None:
                break
            shared.append(b)
        return shared

    def _register_full_blocks(self, seq: Sequence) -> None:
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self._full_block_hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.register(seq.block_ids[i], hashes[i])
        seq.num_registered_blocks = full
