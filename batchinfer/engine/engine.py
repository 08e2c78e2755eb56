"""The engine loop and its Python API: `Engine(config).generate(requests) -> Iterator[Result]`.

generate() pulls requests lazily (at most about 2 x max_num_seqs wait at any time, so millions of
rows stream through bounded memory), runs steps until everything it pulled has finished, and yields
each Result as soon as its request finishes. A request that can never run (too long, token ids out
of the vocabulary, a constraint no grammar backend compiles) yields an error Result, never raises.

Per-step stats (StepStats) are kept in `engine.last_step` and passed to the optional `on_step`
callback.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Iterator

import numpy as np

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from batchinfer.engine.kv_cache import BlockAllocator
from batchinfer.engine.model_runner import ModelRunner
from batchinfer.engine.request import Request, RequestTimes, Result
from batchinfer.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from batchinfer.engine.sequence import Sequence, SequenceStatus
from batchinfer.engine.stats import StepStats
from batchinfer.models.loader import load_tokenizer
from batchinfer.structured.base import Constraint, GrammarError


class Engine:
    """Offline generation over a stream of requests with continuous batching."""

    def __init__(self, config: EngineConfig, on_step: Callable[[StepStats], None] | None = None) -> None:
        self.config = config
        self.on_step = on_step
        self.runner = ModelRunner(config)
        self.model_info = self.runner.info
        self.tokenizer = load_tokenizer(self.model_info.model_dir)
        self.max_model_len = self.runner.max_model_len
        self.allocator = BlockAllocator(self.runner.num_blocks, config.block_size)
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_sharing=config.enable_prefix_sharing,
        )
        self.scheduler = Scheduler(sched_cfg, self.allocator)
        self.eos_token_ids = frozenset(self.model_info.eos_token_ids)
        self.last_step: StepStats | None = None
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self._num_steps = 0
        self._generating = False
        self._compiler = None
        self._grammars: dict[Constraint, object] = {}  # compiled grammar, or the GrammarError message

    # --- public API -------------------------------------------------------------------------

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Yield one Result per request, in finish order, pulling requests only as they are needed."""
        if self._generating:
            raise RuntimeError("Engine.generate is already running; finish or close that iterator first")
        self._generating = True
        source = iter(requests)
        exhausted = False
        max_waiting = 2 * self.config.max_num_seqs
        try:
            while True:
                while not exhausted and len(self.scheduler.waiting) < max_waiting:
                    try:
                        request = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    rejected = self._arrive(request)
                    if rejected is not None:
                        yield rejected
                if not self.scheduler.has_work():
                    if exhausted:
                        return
                    continue
                yield from self._step()
        finally:
            self._abort_all()
            self._generating = False

    # --- arrival ----------------------------------------------------------------------------

    def _arrive(self, request: Request) -> Result | None:
        """Make a Sequence and queue it; an error Result if it can never run."""
        now = time.perf_counter()
        seed = request.sampling.seed if request.sampling.seed is not None else self._rng.getrandbits(63)
        seq = Sequence.from_request(self._next_id, request, seed=seed, arrived=now)
        self._next_id += 1
        error = self._validate(seq)
        if error is not None:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason, seq.error, seq.finished = "error", error, now
            return self._result(seq)
        self.scheduler.add(seq)
        return None

    def _validate(self, seq: Sequence) -> str | None:
        rid = seq.request.request_id
        vocab = self.runner.vocab_size
        try:
            ids = np.asarray(seq.token_ids)
        except (TypeError, ValueError) as exc:
            return f"request {rid}: prompt_token_ids cannot be read as token ids: {exc}"
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            return f"request {rid}: prompt_token_ids must be a flat list of integer token ids, got {ids.dtype} of shape {ids.shape}"
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            bad = ids[(ids < 0) | (ids >= vocab)][0]
            return f"request {rid}: prompt token id {int(bad)} is not in the vocabulary [0, {vocab})"
        seq.token_ids = ids.tolist()  # plain Python ints, whatever sequence type the caller gave
        problem = self.scheduler.check(seq)
        if problem is not None:
            return f"request {rid}: {problem}"
        constraint = seq.request.constraint
        if constraint is not None:
            grammar = self._grammar(constraint)
            if isinstance(grammar, str):
                return f"request {rid}: {grammar}"
            seq.matcher = grammar.new_matcher()
        if seq.request.sampling.stop:
            skip = seq.request.sampling.skip_special_tokens
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, list(seq.token_ids), skip_special_tokens=skip)
        return None

    def _grammar(self, constraint: Constraint):
        """The compiled grammar for a constraint (cached), or the reason it cannot be compiled."""
        if constraint not in self._grammars:
            if self._compiler is None:
                from batchinfer.structured.compiler import GrammarCompiler

                self._compiler = GrammarCompiler(
                    self.tokenizer,
                    self.runner.vocab_size,
                    self.config.grammar_backend,
                    eos_ids=self.model_info.eos_token_ids,
                )
            try:
                self._grammars[constraint] = self._compiler.compile(constraint)
            except (GrammarError, ValueError) as exc:
                self._grammars[constraint] = f"constraint cannot be compiled: {exc}"
        return self._grammars[constraint]

    # --- one step ---------------------------------------------------------------------------

    def _step(self) -> list[Result]:
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        for seq in step.seqs:
            if seq.scheduled is None:
                seq.scheduled = t0
        sampling = [s for s, flag in zip(step.seqs, step.samples) if flag]
        tokens: list[int] = []
        t1 = t0
        if step.seqs:
            batch = self.runner.prepare(step.seqs, step.num_tokens, step.samples)
            t1 = time.perf_counter()
            logits = self.runner.forward(batch)  # asynchronous on a GPU: masks are built meanwhile
            bans = [self._bans(s) for s in sampling]
            bitmask = self._bitmask(sampling)
            tokens = self.runner.sample(logits, sampling, bans, bitmask)
        self.scheduler.complete_step(step)
        now = time.perf_counter()
        finished = [seq for seq, token in zip(sampling, tokens) if self._append(seq, token, now)]
        results = []
        for seq in finished:
            self.scheduler.finish(seq)
            results.append(self._result(seq))
        self._report(step, t0, t1, len(results))
        return results

    def _bans(self, seq: Sequence) -> list[int]:
        """Tokens that may not end the output yet (min_tokens)."""
        p = seq.request.sampling
        if seq.num_generated >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        return sorted(i for i in ids if 0 <= i < self.runner.vocab_size)

    def _bitmask(self, sampling: list[Sequence]):
        """int32 CPU bitmask for the sampling rows, or None when no row has a grammar."""
        if not any(s.matcher is not None for s in sampling):
            return None
        from batchinfer.structured.bitmask import allocate_token_bitmask

        mask = allocate_token_bitmask(len(sampling), self.runner.vocab_size)
        for row, seq in enumerate(sampling):
            if seq.matcher is not None:
                seq.matcher.fill_next_token_bitmask(mask, row)
        return mask

    def _append(self, seq: Sequence, token: int, now: float) -> bool:
        """Add a sampled token; decide whether the sequence is finished (and why). True if finished.

        A final EOS / stop token id stays in output_token_ids but not in the text.
        """
        p = seq.request.sampling
        seq.token_ids.append(token)
        if seq.first_token is None:
            seq.first_token = now
        ends_by_id = token in p.stop_token_ids or (token in self.eos_token_ids and not p.ignore_eos)
        reason: str | None = "stop" if ends_by_id else None
        error: str | None = None
        text: str | None = None
        if seq.matcher is not None:
            if not seq.matcher.accept_token(token):
                reason = "error"
                error = f"request {seq.request.request_id}: the grammar rejected sampled token {token}"
            elif seq.matcher.is_terminated():
                reason = reason or "stop"
        if seq.detokenizer is not None and not ends_by_id:
            new = seq.detokenizer.add(token)
            if reason is None and seq.num_generated >= p.min_tokens:  # as vLLM: not before min_tokens
                cut = find_stop_string(seq.detokenizer.text, p.stop, len(new))
                if cut is not None:
                    reason, text = "stop", seq.detokenizer.text[:cut]
        if reason is None and (seq.num_generated >= seq.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = "length"
        if reason is None:
            return False
        seq.finish_reason, seq.error = reason, error
        seq.text = text if text is not None else self._final_text(seq, drop_last=ends_by_id)
        seq.finished = now
        return True

    def _final_text(self, seq: Sequence, drop_last: bool) -> str:
        if seq.detokenizer is not None:
            piece = seq.detokenizer.flush()  # bytes held back at the end
            text = seq.detokenizer.text
            cut = find_stop_string(text, seq.request.sampling.stop, len(piece))
            return text if cut is None else text[:cut]
        ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=seq.request.sampling.skip_special_tokens)

    def _result(self, seq: Sequence) -> Result:
        prompt = list(seq.token_ids[: seq.num_prompt_tokens])
        output = list(seq.output_token_ids)
        return Result(
            request_id=seq.request.request_id,
            prompt_token_ids=prompt,
            output_token_ids=output,
            text=seq.text,
            finish_reason=seq.finish_reason,
            prompt_tokens=len(prompt),
            completion_tokens=len(output),
            error=seq.error,
            times=RequestTimes(seq.arrived, seq.scheduled, seq.first_token, seq.finished),
            num_preemptions=seq.num_preemptions,
        )

    def _report(self, step: ScheduledStep, t0: float, t1: float, num_finished: int) -> None:
        self._num_steps += 1
        end = time.perf_counter()
        stats = StepStats(
            step=self._num_steps,
            time=end,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=step.num_decode_tokens,
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_free=self.allocator.num_free,
            num_preemptions=len(step.preempted),
            schedule_ms=(t1 - t0) * 1000.0,
            step_ms=(end - t0) * 1000.0,
            num_finished=num_finished,
        )
        self.last_step = stats
        if self.on_step is not None:
            self.on_step(stats)

    def _abort_all(self) -> None:
        """Drop every unfinished sequence (the caller stopped iterating): free all their blocks."""
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
        self.scheduler.waiting.clear()
