"""Speculative decoding: draft tokens per decoding sequence, verify them all in one forward.

Drafts come from the sources of engine/drafts.py (SpeculativeConfig.method):
  ngram: prompt lookup. The longest recent suffix (sizes `ngram_sizes`, longest first) of the
    sequence's own tokens that also occurs earlier in its prompt + output proposes the tokens that
    followed that earlier occurrence (the most recent one), tokens compared ignoring a leading
    space. Documents copy spans of their input.
  grammar: the tokens the sequence's grammar forces from its state (GrammarMatcher.forced_tokens:
    keys, quotes, braces of a JSON schema), then the tokenizer's encoding of the rest of the text
    it forces (GrammarMatcher.forced_text, where the library's forced tokens stop at an ambiguous
    tokenisation).
  ngram+grammar: grammar drafts first, then n-gram drafts from the state after them.
A `drafter` callable given to the Engine replaces the n-gram source (the bench's oracle).
The step stats count each source apart (StepStats spec_forced_* and spec_text_*; the rest n-gram).

A decoding sequence with k drafts computes k+1 tokens in the step (an extend chunk over the paged KV
cache), and logits are kept at all k+1 positions. Position j is sampled exactly as plain decoding
would sample the sequence's (g+j)-th output token: same bans (min_tokens at g+j), the grammar's mask
after the drafts before j, and the sampler's counter g+j (engine/sampler.py keys its noise by seed
and counter, never by batch row). The longest prefix of drafts equal to those draws is accepted,
plus the draw after it: the output is token-identical to decoding without speculation, greedy and
seeded sampling alike. KV slots of rejected drafts are beyond the sequence's computed count: they
are overwritten later, and prefix hashes are only registered for computed blocks, after the drafts
were replaced by the tokens actually emitted.

Grammar: before verifying, each draft is cut at its first token the mask does not allow; the
matcher accepts the drafts while the masks of every position are filled, then rolls back; the
emitted tokens are accepted afterwards, as plain decoding does.

Scheduling: drafts sit at the end of token_ids (Sequence.num_draft) while the scheduler plans the
step, so they count against the token budget and get KV blocks; the scheduler trims drafts it cannot
fit, a preempted sequence drops them. The n-gram draft length adapts per sequence to its measured
acceptance (engine/drafts.py DraftLength: off for a sequence whose drafts are rarely right, probed
again now and then), and no drafts are made when the step already has `max_step_tokens` tokens
without them (it is compute-bound: verifying would cost, not save).
Speculation runs the serial loop (EngineConfig.overlap is ignored) and fills the masks of drafted
positions on the loop's thread. On a GPU a step with drafts replays a CUDA graph: a mixed-step one
where it samples at most max_num_seqs rows, else a verify graph (engine/cuda_graphs.py VerifyGraphs:
every token row may sample, up to max_step_tokens tokens).
Sequences that ask for logprobs get no drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from batchinfer.engine.drafts import DraftLength, ForcedText, match_keys, ngram_draft
from batchinfer.engine.finish import append_token, make_result
from batchinfer.engine.request import Result
from batchinfer.engine.sequence import Sequence, SequenceStatus

_NO_BANS: list[int] = []  # shared by every row with no banned token (the sampler only reads it)

SpeculativeMethod = Literal["ngram", "grammar", "ngram+grammar"]
METHODS = ("ngram", "grammar", "ngram+grammar")

# A drafter: (sequence, most tokens) -> draft token ids following the sequence's tokens.
Drafter = Callable[[Sequence, int], Seq[int]]


@dataclass(frozen=True)
class SpeculativeConfig:
    """engine.speculative: method ngram | grammar | ngram+grammar; num_tokens: most drafts per
    sequence and step; ngram_sizes: suffix lengths tried, longest first; max_step_tokens: no drafts
    in a step that already computes this many tokens without them; adaptive: adapt each sequence's
    n-gram draft length to its acceptance (off: always as many as fit); accept_threshold: with
    adaptive, draft the j-th n-gram token while the estimated chance that it is accepted is at
    least this; probe_interval: steps between one-token probes of a sequence whose n-gram drafts
    are off (engine/drafts.py DraftLength)."""

    __pydantic_config__ = {"extra": "forbid"}  # the job file's engine.speculative: unknown keys are errors

    method: SpeculativeMethod = "ngram"
    num_tokens: int = 4
    ngram_sizes: tuple[int, ...] = (3, 2, 1)
    max_step_tokens: int = 2048
    adaptive: bool = True
    accept_threshold: float = 0.1
    probe_interval: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative.method must be one of {', '.join(METHODS)}, not {self.method!r}")
        if self.num_tokens < 1:
            raise ValueError(f"speculative.num_tokens must be at least 1, got {self.num_tokens}")
        sizes = tuple(int(n) for n in self.ngram_sizes)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"speculative.ngram_sizes must be positive sizes, got {list(self.ngram_sizes)}")
        object.__setattr__(self, "ngram_sizes", tuple(sorted(set(sizes), reverse=True)))
        if self.max_step_tokens < 1:
            raise ValueError(f"speculative.max_step_tokens must be at least 1, got {self.max_step_tokens}")
        if not 0.0 < self.accept_threshold <= 1.0:
            raise ValueError(f"speculative.accept_threshold must be in (0, 1], got {self.accept_threshold}")
        if self.probe_interval < 1:
            raise ValueError(f"speculative.probe_interval must be at least 1, got {self.probe_interval}")

    @property
    def uses_ngram(self) -> bool:
        return "ngram" in self.method

    @property
    def uses_grammar(self) -> bool:
        return "grammar" in self.method


@dataclass
class SpecState:
    """Per-sequence drafter state: its tokens and their match keys as growing numpy buffers, its
    n-gram draft length."""

    buf: np.ndarray
    keys: np.ndarray
    size: int = 0
    length: DraftLength = field(default_factory=DraftLength)

    def tokens(self, token_ids: list[int], key_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The sequence's tokens (no drafts) and their keys, appending only what is new since last time."""
        n = len(token_ids)
        if n > self.buf.shape[0]:
            cap = max(n, 2 * self.buf.shape[0])
            self.buf = np.concatenate([self.buf[: self.size], np.empty(cap - self.size, dtype=np.int64)])
            self.keys = np.concatenate([self.keys[: self.size], np.empty(cap - self.size, dtype=np.int64)])
        if n > self.size:
            self.buf[self.size : n] = token_ids[self.size : n]
            self.keys[self.size : n] = key_of[self.buf[self.size : n]]
        self.size = n
        return self.buf[:n], self.keys[:n]


@dataclass
class SpecCounts:
    """One step's speculation counts (StepStats spec_*)."""

    drafted: int = 0  # draft tokens proposed
    verified: int = 0  # draft tokens computed by the step (after grammar cuts and the budget)
    accepted: int = 0  # draft tokens the target's own draws confirmed
    rows: int = 0  # decoding sequences that verified at least one draft
    decode_rows: int = 0  # decoding sequences of the step (emitted = decode_rows + accepted, about)
    emitted: int = 0  # tokens appended to decoding sequences this step
    # of those drafts, the grammar-forced tokens and the forced text's tokens (in that order at the
    # start of a draft; the rest are n-gram or drafter tokens)
    forced_drafted: int = 0
    forced_verified: int = 0
    forced_accepted: int = 0
    text_drafted: int = 0
    text_verified: int = 0
    text_accepted: int = 0


def spec_fields(c: SpecCounts) -> dict[str, int]:
    """StepStats keyword arguments of a step's counts."""
    return dict(spec_drafted=c.drafted, spec_verified=c.verified, spec_accepted=c.accepted, spec_rows=c.rows,
                spec_decode_rows=c.decode_rows, spec_emitted=c.emitted, spec_forced_drafted=c.forced_drafted,
                spec_forced_verified=c.forced_verified, spec_forced_accepted=c.forced_accepted,
                spec_text_drafted=c.text_drafted, spec_text_verified=c.text_verified, spec_text_accepted=c.text_accepted)


def _allowed(mask_row: torch.Tensor, token: int) -> bool:
    return (int(mask_row[token >> 5]) >> (token & 31)) & 1 == 1


@dataclass
class _Plan:
    """A decoding sequence's drafts and the grammar masks of its k+1 positions (None: no grammar)."""

    seq: Sequence
    masks: torch.Tensor | None = None
    proposed: int = 0
    forced: int = 0  # the draft's first `forced` tokens are grammar-forced,
    text: int = 0  # the `text` after them the forced text's; the rest n-gram (or the drafter's)


class Speculator:
    """Runs whole engine steps with speculative decoding (called by Engine._step when configured)."""

    def __init__(self, config: SpeculativeConfig, vocab_size: int, drafter: Drafter | None = None,
                 tokenizer: Any = None) -> None:
        """tokenizer: the model's (match keys of the n-gram source, the forced text's tokens; None:
        token-exact n-gram matching and no forced-text drafts)."""
        self.config = config
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.drafter = drafter
        self.key_of = match_keys(tokenizer, vocab_size) if tokenizer is not None and config.uses_ngram else (
            np.arange(vocab_size, dtype=np.int64))
        self.forced_text = ForcedText(tokenizer) if tokenizer is not None and config.uses_grammar else None

    # --- drafting ---------------------------------------------------------------------------

    def _draft_budget(self, engine: Any) -> int:
        """Draft tokens this step may verify: max_step_tokens minus what the step computes anyway."""
        sched = engine.scheduler
        decodes = sum(1 for s in sched.running if s.num_remaining == 1)
        prefill = sum(s.num_remaining for s in sched.running if s.num_remaining > 1)
        prefill += sum(s.num_remaining for s in sched.waiting) if len(sched.running) < sched.config.max_num_seqs else 0
        base = min(sched.config.max_num_batched_tokens, decodes + prefill)
        return max(0, min(self.config.max_step_tokens, sched.config.max_num_batched_tokens) - base)

    def propose(self, engine: Any) -> dict[int, _Plan]:
        """Append drafts to every decoding sequence (within the budget); their plans by id(seq)."""
        plans: dict[int, _Plan] = {}
        budget = self._draft_budget(engine)
        cfg = self.config
        for seq in engine.scheduler.running:
            if budget <= 0:
                break
            if seq.num_remaining != 1 or seq.num_computed_tokens < seq.num_prompt_tokens or seq.logprobs is not None:
                continue
            room = min(cfg.num_tokens, budget, seq.max_tokens - seq.num_generated - 1,
                       engine.max_model_len - seq.num_tokens - 1)
            if room <= 0:
                continue
            if seq.spec is None:
                cap = max(64, 2 * seq.num_tokens)
                seq.spec = SpecState(np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64))
            draft: list[int] = []
            m = seq.matcher
            text = 0
            if m is not None and cfg.uses_grammar:
                draft = [t for t in m.forced_tokens()[:room] if 0 <= t < self.vocab_size]
                if self.forced_text is not None:
                    more = [t for t in self.forced_text.extend(m, draft, room - len(draft)) if 0 <= t < self.vocab_size]
                    text = len(more)
                    draft += more
            forced = len(draft) - text
            ngram_room = room - len(draft)
            if cfg.adaptive and ngram_room > 0:
                ngram_room = seq.spec.length.length(ngram_room, cfg.accept_threshold, cfg.probe_interval)
            if ngram_room > 0 and (cfg.uses_ngram or self.drafter is not None):
                if self.drafter is not None:
                    more = list(self.drafter(seq, len(draft) + ngram_room))[len(draft):]  # after the grammar's
                else:
                    tokens, keys = seq.spec.tokens(seq.token_ids, self.key_of)
                    if draft:
                        extra = np.asarray(draft, dtype=np.int64)
                        tokens, keys = np.concatenate([tokens, extra]), np.concatenate([keys, self.key_of[extra]])
                    more = ngram_draft(tokens, cfg.ngram_sizes, ngram_room, keys).tolist()
                draft += [t for t in more[:ngram_room] if 0 <= t < self.vocab_size][: ngram_room]
            if not draft:
                continue
            plan = _Plan(seq, proposed=len(draft), forced=forced, text=text)
            if m is not None:
                draft, plan.masks = self._grammar_cut(m, draft)
            plans[id(seq)] = plan
            if draft:
                seq.token_ids.extend(draft)
                seq.num_draft = len(draft)
                budget -= len(draft)
        return plans

    def _grammar_cut(self, m: Any, draft: list[int]) -> tuple[list[int], torch.Tensor]:
        """Cut the draft at its first token the grammar forbids; masks of the k+1 positions."""
        masks = torch.full((len(draft) + 1, self.words), -1, dtype=torch.int32)
        valid = 0
        for j, t in enumerate(draft):
            m.fill_next_token_bitmask(masks, j)
            if not _allowed(masks[j], t) or not m.accept_token(t):
                break
            valid += 1
            if m.is_terminated():
                break
        else:
            if not m.is_terminated():
                m.fill_next_token_bitmask(masks, valid)
        if valid:
            m.rollback(valid)
        return draft[:valid], masks[: valid + 1]

    # --- one step ---------------------------------------------------------------------------

    def step(self, engine: Any) -> list[Result]:
        """One serial engine step with drafts: propose, schedule, verify, accept, finish."""
        t0 = time.perf_counter()
        engine._wait_s, engine._idle_ms = 0.0, None
        engine._phases, engine._phase_t = {}, t0
        counts = SpecCounts()
        plans = self.propose(engine)
        counts.drafted = sum(p.proposed for p in plans.values())
        counts.forced_drafted = sum(p.forced for p in plans.values())
        counts.text_drafted = sum(p.text for p in plans.values())
        engine._phase("draft")
        step = engine.scheduler.schedule()
        for seq in engine.scheduler.running:  # drafts of sequences the step does not run
            if seq.num_draft and seq not in step.seqs:
                seq.drop_drafts()
        engine._phase("schedule")
        results: list[Result] = []
        if not step.seqs:
            engine._spec_counts = counts
            engine._report(step, t0, 0)
            return results
        for seq in step.seqs:
            if seq.scheduled is None:
                seq.scheduled = t0
        batch = engine.runner.prepare(step.seqs, step.num_tokens, step.samples)
        sampling = [s for s, flag in zip(step.seqs, step.samples) if flag]
        widths = [1 + s.num_draft for s in sampling]
        ends = np.cumsum(np.asarray(step.num_tokens, dtype=np.int64))[np.asarray(step.samples, dtype=bool)]
        w = np.asarray(widths, dtype=np.int64)
        if int(w.sum()) != len(sampling):
            rows = np.repeat(ends - w, w) + (np.arange(int(w.sum())) - np.repeat(np.cumsum(w) - w, w))
            batch.sample_index = engine.runner._to_device(rows.astype(np.int64))
        engine._phase("prepare")
        logits = engine._device_call(engine.runner.forward, batch)
        engine._phase("launch")
        rows_seq: list[Sequence] = []
        steps: list[int] = []
        bans: list[list[int]] = []
        for seq, width in zip(sampling, widths):
            g = seq.num_generated - seq.num_draft
            rows_seq += [seq] * width
            steps += range(g, g + width)
            if g >= seq.request.sampling.min_tokens:  # past min_tokens at every position: nothing banned
                bans += [_NO_BANS] * width
            else:
                bans += [engine._bans_at(seq, g + j) for j in range(width)]
        bitmask = self._bitmask(sampling, widths, plans)
        engine._phase("grammar_mask")
        tokens: list[int] = []
        logprobs = None
        if sampling:
            tokens_dev = engine._device_call(engine.runner.sample_tokens, logits, rows_seq, bans, bitmask, steps)
            logprobs = engine.runner.token_logprobs(logits, rows_seq, tokens_dev)
            if logprobs is not None:
                logprobs = logprobs.to_host_async()
            t = time.perf_counter()
            tokens = tokens_dev.tolist()
            engine._wait_s += time.perf_counter() - t
        engine._phase("read_tokens")
        now = time.perf_counter()
        # accepted drafts and the emitted tokens of each sampling sequence
        emitted: list[list[int]] = []
        decoding: list[int] = []  # indices (into sampling) of the decoding sequences
        row = 0
        for seq, width in zip(sampling, widths):
            out = tokens[row : row + width]
            draft = seq.token_ids[len(seq.token_ids) - seq.num_draft :] if seq.num_draft else []
            a = 0
            while a < len(draft) and draft[a] == out[a]:
                a += 1
            emitted.append(out[: a + 1])
            if seq.num_computed_tokens >= seq.num_prompt_tokens and seq.num_computed_tokens + 1 + seq.num_draft == seq.num_tokens:
                counts.decode_rows += 1
                decoding.append(len(emitted) - 1)
            if seq.num_draft:
                counts.rows += 1
                counts.verified += seq.num_draft
                counts.accepted += a
                plan = plans.get(id(seq))
                forced = min(plan.forced, seq.num_draft) if plan is not None else 0
                text = min(plan.text, seq.num_draft - forced) if plan is not None else 0
                counts.forced_verified += forced
                counts.forced_accepted += min(a, forced)
                counts.text_verified += text
                counts.text_accepted += max(0, min(a - forced, text))
                if seq.spec is not None and a >= forced + text:  # the n-gram part was reached: measure it
                    seq.spec.length.update(seq.num_draft - forced - text, a - forced - text)
            row += width
        base_rows = np.cumsum([0] + widths[:-1]).tolist()
        num_emitted = {}
        for seq in sampling:
            seq.drop_drafts()
        # append column by column: one batched grammar accept per column
        alive = list(range(len(sampling)))
        col = 0
        while alive:
            pairs = [(sampling[i], emitted[i][col]) for i in alive]
            verdicts = engine.grammar.accept(pairs)
            still = []
            for i, (seq, token), verdict in zip(alive, pairs, verdicts):
                if logprobs is not None and seq.logprobs is not None:
                    seq.logprobs.append(logprobs.entry(base_rows[i] + col, token))
                num_emitted[i] = col + 1
                if append_token(seq, token, now, verdict, engine.eos_token_ids, engine.max_model_len, engine.tokenizer):
                    engine.scheduler.finish(seq)
                    results.append(make_result(seq))
                elif col + 1 < len(emitted[i]):
                    still.append(i)
            alive = still
            col += 1
        # tokens appended (a sequence that ends mid-draft, e.g. at an EOS the grammar forced, takes
        # no token after its last)
        counts.emitted += sum(num_emitted[i] for i in decoding)
        # KV is valid for the last input token and the accepted drafts: that is what was computed
        k_of = {id(s): i for i, s in enumerate(sampling)}
        for idx, seq in enumerate(step.seqs):
            i = k_of.get(id(seq))
            if i is not None and widths[i] > 1:
                step.num_tokens[idx] = num_emitted.get(i, 1)
        engine.scheduler.complete_step(step)
        engine._phase("post")
        engine._spec_counts = counts
        engine._report(step, t0, len(results))
        return results

    def _bitmask(self, sampling: list[Sequence], widths: list[int], plans: dict[int, _Plan]) -> torch.Tensor | None:
        """int32 bitmask of every sampling position (rows of sequences without a grammar all -1)."""
        if not any(s.matcher is not None for s in sampling):
            return None
        mask = torch.full((sum(widths), self.words), -1, dtype=torch.int32)
        row = 0
        for seq, width in zip(sampling, widths):
            if seq.matcher is not None:
                plan = plans.get(id(seq))
                if plan is not None and plan.masks is not None and plan.masks.shape[0] >= width:
                    mask[row : row + width] = plan.masks[:width]
                else:
                    seq.matcher.fill_next_token_bitmask(mask, row)
            row += width
        return mask
