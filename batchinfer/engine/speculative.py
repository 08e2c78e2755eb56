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
fit, a preempted sequence drops them. Drafts come before prompts in the budget, waiting prompts and
running ones still in their chunked prefill alike (the scheduler gives prefill what is left), so a
step that prefills verifies drafts too; with `prefill_first` prompts come first instead. docs1000
(1,000 long prompts, a KV-bound batch) spends most of its run in steps that prefill; with prompts
first most of them verified no draft (BENCHMARKS.md, nineteenth session), and while running prompts
still counted first a lane holding one drafted nothing (twenty-first session). The n-gram draft length adapts per sequence to its measured
acceptance (engine/drafts.py DraftLength: off for a sequence whose drafts are rarely right, probed
again now and then), and a step's decodes with their drafts hold at most `max_step_tokens` tokens
(beyond, the decodes alone make the step compute-bound: verifying would cost, not save).
Where the running sequences leave no room for a draft (has_room; with prefill_first also while
prompts fill the budget) the engine runs its ordinary overlapped loop instead, after draining
the lanes (`lanes_drain`), or lets lane steps carry that prefill without drafts. Whether the other steps draft can be measured as well
(engine/spec_gate.py SpecGate, `gate`): per batch size, the output rate of steps with drafts
against plain steps; the better one runs, the other is probed now and then.
Steps with drafts cannot look ahead as plain steps do (engine.py): with EngineConfig.overlap they
run in two lanes of sequences taking turns, one lane's host work under the other's device work
(engine/lanes.py); without it serially (Speculator.step). The masks of drafted positions are filled on
the loop's thread. A verify step's host work is kept to one pass per sequence per phase and numpy
per row (engine/verify.py:
counters, bans, accepted prefixes, appending; the runner packs the verify rows' sample index with
the step's inputs, and the sampler's per-sequence parameters are repeated per row, not rebuilt;
scripts/spec_host_bench.py measures it). On a GPU a step with drafts replays a CUDA graph: a
mixed-step one, which gathers k+1 rows a sequence where drafts can sit beside prefill (drafts first,
or lane steps carrying prefill: model_runner._mixed_graph_samples); where they cannot (prefill first
with lanes draining) the mixed graphs gather one row a sequence and verify steps replay graphs of
their own (engine/cuda_graphs.py VerifyGraphs: every token row may sample, up to max_step_tokens
tokens).
Sequences that ask for logprobs get no drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from batchinfer.engine.drafts import DraftLength, ForcedText, match_keys, ngram_draft
from batchinfer.engine.grammar import StartedFill
from batchinfer.engine.request import Result
from batchinfer.engine.sampled_tokens import SampledTokens
from batchinfer.engine.sequence import Sequence
from batchinfer.engine.spec_gate import SpecGate
from batchinfer.engine.verify import (
    append_emitted,
    generated_before,
    row_bans,
    row_starts,
    row_steps,
    settle_drafts,
)
from batchinfer.structured.bitmask import RowMasks

SpeculativeMethod = Literal["ngram", "grammar", "ngram+grammar"]
METHODS = ("ngram", "grammar", "ngram+grammar")

# A drafter: (sequence, most tokens) -> draft token ids following the sequence's tokens.
Drafter = Callable[[Sequence, int], Seq[int]]


@dataclass(frozen=True)
class SpeculativeConfig:
    """engine.speculative: method ngram | grammar | ngram+grammar; num_tokens: most drafts per
    sequence and step; ngram_sizes: suffix lengths tried, longest first; max_step_tokens: the most
    tokens a step's decodes and their drafts may hold (with prefill_first its prefill counts too);
    adaptive: adapt each sequence's
    n-gram draft length to its acceptance (off: always as many as fit); accept_threshold: with
    adaptive, draft the j-th n-gram token while the estimated chance that it is accepted is at
    least this; probe_interval: steps between one-token probes of a sequence whose n-gram drafts
    are off (engine/drafts.py DraftLength); gate: speculate only where steps with drafts measure
    a higher output rate than plain steps (engine/spec_gate.py); off (the default: on an H200 it
    changed little either way, BENCHMARKS.md): every step with room for drafts drafts; lanes: run
    verify steps in two lanes of sequences taking turns (engine/lanes.py); None: on a GPU with
    EngineConfig.overlap (on the CPU the model runs on the host, so no host work would hide);
    prefill_first: prompts' tokens (running prompts' remaining prefill, then waiting prompts') come
    before drafts in a step's budget (no drafts while prompts fill it); off (the default): the
    decoding sequences' drafts come first and the prompts take the rest of the budget, so the steps
    that prefill verify drafts as well;
    lanes_drain: with lanes, a step without room for drafts (with prefill_first: prompts filling the
    budget) drains both lanes and runs the plain overlapped loop until there is room again (the
    default); off: lane steps carry that prefill, without drafts. docs1000, H100, one call
    (BENCHMARKS.md twenty-first session, before drafts came first for running prompts): carrying
    19.03 s against draining 22.47 s, once carrying steps replayed wide mixed graphs (eagerly,
    19 ms of launch a step, carrying was the slower: 21.43 against 19.85 s)."""

    __pydantic_config__ = {"extra": "forbid"}  # the job file's engine.speculative: unknown keys are errors

    method: SpeculativeMethod = "ngram"
    num_tokens: int = 4
    ngram_sizes: tuple[int, ...] = (3, 2, 1)
    max_step_tokens: int = 2048
    adaptive: bool = True
    accept_threshold: float = 0.1
    probe_interval: int = 8
    gate: bool = False
    lanes: bool | None = None
    prefill_first: bool = False
    lanes_drain: bool = True

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

    @classmethod
    def new(cls, num_tokens: int) -> SpecState:
        """Empty buffers for a sequence of num_tokens tokens (room to grow)."""
        cap = max(64, 2 * num_tokens)
        return cls(np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64))

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
    """A decoding sequence's drafts from a grammar and the masks of its k+1 positions."""

    seq: Sequence
    masks: torch.Tensor | None = None
    forced: int = 0  # the draft's first `forced` tokens are grammar-forced,
    text: int = 0  # the `text` after them the forced text's; the rest n-gram (or the drafter's)


@dataclass
class VerifyStep:
    """A launched verify step: its tokens are read by Speculator.finish (tokens None: nothing samples)."""

    step: Any  # engine/scheduler.ScheduledStep
    sampling: list[Sequence]
    widths: np.ndarray
    plans: dict[int, _Plan]
    counts: SpecCounts
    tokens: SampledTokens | None = None
    # CUDA timing events (end of the step launched before, start, end of forward, start of sampling),
    # for the device's idle gaps around this step (None on the CPU or without sampling rows)
    marks: tuple[Any, Any, Any, Any] | None = None


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
        self.gate = SpecGate() if config.gate else None

    # --- drafting ---------------------------------------------------------------------------

    def has_room(self, engine: Any) -> bool:
        """Whether the next step could verify any draft. Not while the decoding sequences alone fill
        max_step_tokens, nor, with prefill_first, while prefill fills the step's token budget: then a
        step with drafts is a plain step run serially (engine.py)."""
        return self._draft_budget(engine) > 0

    def _draft_budget(self, engine: Any, lane: int | None = None) -> int:
        """Draft tokens this step (of one lane, or of every running sequence) may verify:
        max_step_tokens minus the decoding sequences' tokens; with prefill_first also minus the
        prompts' (running ones' remaining prefill, then waiting ones', up to the token budget).
        Without it prompts take what the decodes and drafts leave (Scheduler.schedule places
        decodes with their drafts before prefill chunks)."""
        sched = engine.scheduler
        most = sched.config.max_num_batched_tokens
        first = self.config.prefill_first
        base = 0  # tokens of the step without drafts that come before them (up to `most`)
        for s in engine.scheduler.running_in(lane):
            pending = len(s.token_ids) - s.num_computed_tokens - s.num_draft  # (drafts: a lane's step in flight)
            if pending == 1 or first:
                base += pending
        if first and len(sched.running) < sched.config.max_num_seqs:
            for s in sched.waiting:
                if base >= most:
                    break
                base += s.num_remaining
        return max(0, min(self.config.max_step_tokens, most) - min(most, base))

    def propose(self, engine: Any, counts: SpecCounts, lane: int | None = None) -> dict[int, _Plan]:
        """Append drafts to every decoding sequence (of the lane, if given; within the budget), counted into `counts`
        (drafted, forced_drafted, text_drafted). Returns the plans of the sequences with a grammar
        that drafted, by id(seq) (a draft without a grammar needs none: its tokens are all n-gram
        or the drafter's)."""
        plans: dict[int, _Plan] = {}
        drafted = 0
        budget = self._draft_budget(engine, lane)
        cfg = self.config
        max_len = engine.max_model_len
        grammar = cfg.uses_grammar
        more_source = cfg.uses_ngram or self.drafter is not None
        for seq in engine.scheduler.running_in(lane):
            if budget <= 0:
                break
            n, c = len(seq.token_ids), seq.num_computed_tokens
            if n - c != 1 or c < seq.num_prompt_tokens or seq.logprobs is not None:
                continue  # not decoding, or asks for logprobs
            room = min(cfg.num_tokens, budget, seq.max_tokens - (n - seq.num_prompt_tokens) - 1, max_len - n - 1)
            if room <= 0:
                continue
            if seq.spec is None:
                seq.spec = SpecState.new(n)
            m = seq.matcher
            draft, text = self._grammar_draft(m, room) if m is not None and grammar else ([], 0)
            forced = len(draft) - text
            more = room - len(draft)
            if cfg.adaptive and more > 0:
                more = seq.spec.length.length(more, cfg.accept_threshold, cfg.probe_interval)
            if more > 0 and more_source:
                draft += self._more_drafts(seq, draft, more)
            if not draft:
                continue
            drafted += len(draft)
            if m is not None:
                counts.forced_drafted += forced
                counts.text_drafted += text
                plan = plans[id(seq)] = _Plan(seq, forced=forced, text=text)
                draft, plan.masks = self._grammar_cut(m, draft)
            if draft:
                seq.token_ids.extend(draft)
                seq.num_draft = len(draft)
                budget -= len(draft)
        counts.drafted += drafted
        return plans

    def _grammar_draft(self, m: Any, room: int) -> tuple[list[int], int]:
        """Up to `room` grammar drafts: the forced tokens, then the forced text's; (draft, number of text tokens)."""
        vocab = self.vocab_size
        draft = [t for t in m.forced_tokens()[:room] if 0 <= t < vocab]
        if self.forced_text is None:
            return draft, 0
        more = [t for t in self.forced_text.extend(m, draft, room - len(draft)) if 0 <= t < vocab]
        return draft + more, len(more)

    def _more_drafts(self, seq: Sequence, draft: list[int], k: int) -> list[int]:
        """Up to k drafts after `draft` from the drafter, else by n-gram lookup."""
        if self.drafter is not None:
            more = list(self.drafter(seq, len(draft) + k))[len(draft):]  # after the grammar's
        else:
            tokens, keys = seq.spec.tokens(seq.token_ids, self.key_of)
            if draft:
                extra = np.asarray(draft, dtype=np.int64)
                tokens, keys = np.concatenate([tokens, extra]), np.concatenate([keys, self.key_of[extra]])
            more = ngram_draft(tokens, self.config.ngram_sizes, k, keys).tolist()
        vocab = self.vocab_size
        return [t for t in more[:k] if 0 <= t < vocab][:k]

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
        """One serial engine step with drafts: propose, schedule, verify, then accept and finish."""
        t0 = engine._begin_iteration()
        verify = self.launch(engine)
        results = self.finish(engine, verify) if verify.step.seqs else []
        engine._spec_counts = verify.counts
        engine._report(verify.step, t0, len(results))
        return results

    def launch(self, engine: Any, lane: int | None = None) -> VerifyStep:
        """Propose drafts, schedule the step (of one lane's sequences, or all), launch its forward and
        sampling, and start the copy of its tokens to the host; nothing here waits for the device."""
        counts = SpecCounts()
        plans = self.propose(engine, counts, lane)
        engine._phase("draft")
        step = engine.scheduler.schedule(lane)
        if counts.drafted:
            scheduled = set(step.seqs)
            for seq in engine.scheduler.running_in(lane):  # drafts of sequences the step does not run
                if seq.num_draft and seq not in scheduled:
                    seq.drop_drafts()
        engine._phase("schedule")
        if not step.seqs:
            return VerifyStep(step, [], np.zeros(0, dtype=np.int64), plans, counts)
        t0 = time.perf_counter()
        for seq in step.seqs:
            if seq.scheduled is None:
                seq.scheduled = t0
        sampling = [s for s, flag in zip(step.seqs, step.samples) if flag]
        widths = np.fromiter((1 + s.num_draft for s in sampling), dtype=np.int64, count=len(sampling))
        own = self._own_masks(sampling, widths, plans)
        # the other rows' masks fill on the library's threads while the step is packed and launched
        fill = engine.grammar.start_fill(sampling, [], [], [m is None for m in own])
        engine._phase("grammar_fill_start")
        batch = engine.runner.prepare(step.seqs, step.num_tokens, step.samples, sample_widths=widths)
        engine._phase("prepare")
        before, start = engine._last_end, engine.runner.mark()
        logits = engine._device_call(engine.runner.forward, batch)
        forward_end = engine.runner.mark()
        engine._phase("launch")
        tokens, sample_start = self._sample(engine, logits, sampling, widths, own, fill)
        marks = None
        if tokens is not None and start is not None:
            marks = (before, start, forward_end, sample_start)
            engine._last_end = tokens.event  # the stream's last step now: the next step's gap starts here
        return VerifyStep(step, sampling, widths, plans, counts, tokens, marks)

    def finish(self, engine: Any, verify: VerifyStep) -> list[Result]:
        """Wait for a launched step's tokens, accept each draft's matching prefix, append the emitted
        tokens and finish the sequences they end. The finished Results."""
        results: list[Result] = []
        if verify.tokens is not None:
            t = time.perf_counter()
            tokens = verify.tokens.tolist()
            engine._wait_s += time.perf_counter() - t
            engine._phase("read_tokens")
            if verify.marks is not None:  # the device's idle gaps around this step, as for a plain step
                engine._idle_ms = engine._idle_gaps_ms(verify.marks)
            results = self._emit(engine, verify.step, verify.sampling, verify.widths, tokens,
                                 verify.tokens.logprobs, verify.counts, verify.plans)
            engine._phase("post")
        elif verify.step.seqs:  # prefill chunks only (no prompt ends in this step): nothing to read
            engine.scheduler.complete_step(verify.step)
        return results

    def _sample(self, engine: Any, logits: torch.Tensor, sampling: list[Sequence], widths: np.ndarray,
                own: list[torch.Tensor | None], fill: StartedFill | None) -> tuple[SampledTokens | None, Any]:
        """Launch the draw of every sampling row (sequence i's widths[i] positions) as plain decoding
        would draw each position: its counter, its min_tokens bans, its grammar mask; the tokens (and
        the logprobs where asked) are copied to the host without waiting (None: no row samples).
        Also the timing event recorded where the draw starts (None on the CPU)."""
        first = generated_before(sampling)
        steps = row_steps(first, widths)
        bans = row_bans(sampling, widths, first, engine._bans_at)
        bitmask = self._bitmask(engine, sampling, widths, own, fill)
        engine._phase("grammar_mask")
        if not sampling:
            return None, None
        sample_start = engine.runner.mark()
        tokens_dev = engine._device_call(engine.runner.sample_tokens, logits, sampling, bans, bitmask, steps, widths)
        logprobs = self._logprobs(engine, logits, sampling, widths, tokens_dev)
        tokens = SampledTokens(tokens_dev, logprobs)
        engine._phase("sample_launch")
        return tokens, sample_start

    @staticmethod
    def _emit(engine: Any, step: Any, sampling: list[Sequence], widths: np.ndarray, tokens: list[int], logprobs: Any,
              counts: SpecCounts, plans: dict[int, _Plan]) -> list[Result]:
        """Accept each draft's matching prefix, append the emitted tokens, finish sequences, and
        complete the step with the tokens whose KV it computed. The finished Results."""
        now = time.perf_counter()
        width_list = widths.tolist()
        emitted, decoding = settle_drafts(sampling, width_list, tokens, counts, plans)
        appended, results = append_emitted(engine, sampling, emitted, row_starts(widths).tolist(), logprobs, now)
        engine._appended += sum(appended)
        # tokens appended (a sequence that ends mid-draft, e.g. at an EOS the grammar forced, takes
        # no token after its last)
        counts.emitted += sum(n for n, d in zip(appended, decoding) if d)
        # KV is valid for the last input token and the accepted drafts: that is what was computed
        for i, idx in enumerate(np.flatnonzero(np.asarray(step.samples, dtype=bool)).tolist()):
            if width_list[i] > 1:
                step.num_tokens[idx] = appended[i]
        engine.scheduler.complete_step(step)
        return results

    @staticmethod
    def _logprobs(engine: Any, logits: torch.Tensor, sampling: list[Sequence], widths: np.ndarray, tokens: torch.Tensor):
        """The step's logprobs (on the device), when a sequence asks (those have no drafts)."""
        if all(s.request.sampling.logprobs is None for s in sampling):
            return None
        rows_seq = [s for s, w in zip(sampling, widths.tolist()) for _ in range(w)]
        return engine.runner.token_logprobs(logits, rows_seq, tokens)

    @staticmethod
    def _own_masks(sampling: list[Sequence], widths: np.ndarray, plans: dict[int, _Plan]) -> list[torch.Tensor | None]:
        """Per sampling row: the masks of its positions when its sequence drafted under a grammar
        (those its draft was cut with), else None (its one position takes the engine's masks)."""
        own: list[torch.Tensor | None] = [None] * len(sampling)
        for i, (seq, width) in enumerate(zip(sampling, widths.tolist())):
            plan = plans.get(id(seq)) if seq.matcher is not None else None
            if plan is not None and plan.masks is not None and plan.masks.shape[0] >= width:
                own[i] = plan.masks[:width]
        return own

    def _bitmask(self, engine: Any, sampling: list[Sequence], widths: np.ndarray,
                 own: list[torch.Tensor | None], fill: StartedFill | None) -> RowMasks | None:
        """The masks of every sampling position (RowMasks; rows of sequences without a grammar
        all-allowed). A drafted sequence's positions take its `own` masks (_own_masks); the other
        sequences' one position takes the engine's grammar masks (engine/grammar.py: one per
        grammar state, kept across steps, filled on the library's threads; `fill`: started before
        the step was packed), as a plain step's would. Filling those here one row at a time on the
        loop's thread cost 21 ms of a 29 ms verify step (docs1000-json, ~124 rows, H100,
        BENCHMARKS.md twentieth session). On a GPU the table and index go to the device from pinned
        memory, as a plain step's do (with the drafted rows' masks joined in pageable memory,
        sample_launch took 8.1 ms of a lane's 20 ms step against 1.3 ms in a plain step, H100,
        twenty-second session)."""
        if not any(s.matcher is not None for s in sampling):
            return None
        width_list = widths.tolist()
        shared = engine.grammar.bitmask(sampling, [m is None for m in own], fill)
        base = shared.table if shared is not None else torch.full((1, self.words), -1, dtype=torch.int32)
        extra = [m for m in own if m is not None]
        table = torch.cat([base, *extra]) if extra else base
        index = np.zeros(int(widths.sum()), dtype=np.int64)  # slot 0 of either base: all-allowed
        row, slot = 0, base.shape[0]
        for i, width in enumerate(width_list):
            if own[i] is not None:
                index[row : row + width] = np.arange(slot, slot + width)
                slot += width
            elif shared is not None:
                index[row] = int(shared.index[i])  # (a sequence with a grammar drafts only with its masks)
            row += width
        index_t = torch.from_numpy(index)
        if engine.grammar.pin_memory:  # a copy from pageable memory may wait for the device's queue
            table = table if table.is_pinned() else table.pin_memory()  # (joined, or every row its own masks)
            index_t = index_t.pin_memory()
        return RowMasks(table, index_t)
