"""The engine loop and its Python API: `Engine(config).generate(requests) -> Iterator[Result]`.

generate() pulls requests lazily (at most about 2 x max_num_seqs wait at any time, so millions of
rows stream through bounded memory), runs steps until everything it pulled has finished, and yields
each Result as soon as its request finishes. A request that can never run (too long, token ids out
of the vocabulary, a constraint no grammar backend compiles) yields an error Result, never raises.

Per-step stats (StepStats) are kept in `engine.last_step` and passed to the optional `on_step`
callback. `close()` (or `with Engine(...) as engine:`) releases the device memory at once: the CUDA
graphs and their pools, the KV cache, the model (dropping the last reference does the same).

This module is the loop; its parts live next to it: scheduler.py (what runs each step),
model_runner.py (packing, forward, sampling), grammar.py (compiled grammars, accept, masks),
finish.py (stop checks, final text, the Result).

Overlap (`EngineConfig.overlap`, on by default): a one-step lookahead, so that the host builds step
N+1 while the device runs step N. One loop iteration (`_step`) samples one step, N+1, whose forward
is normally already queued (launched at the end of the iteration before):

  1. (first iteration, or no step was planned) schedule and pack N+1 now and launch its forward;
     the input id of each decoding row is gathered ON THE DEVICE from N's sampled-token tensor
     (model_runner.gather_pending), so nothing waits for N here;
  2. read N's tokens (waits on a CUDA event recorded after their copy to pinned host memory: the only
     host sync per step); feed them to the grammars (one batched accept per library) and start
     N+1's grammar masks (engine/grammar.py; on a helper thread where the library's fill holds no GIL); then
     post-process: swap placeholders for tokens, stop checks, finish sequences (blocks freed now);
  3. complete N+1's bookkeeping, build its bans, give every sequence N+1 samples for a placeholder
     token (sequence.py), so that it is planned as if its token were known (a sequence whose
     pending token is surely its last, by max_tokens / max_model_len, is not scheduled);
  4. plan N+2: schedule and pack it, while N+1's masks fill on the grammar threads;
  5. wait for N+1's grammar masks (the matchers had accepted N's tokens, so masks are exact), launch
     its sampling and the copy of its tokens: N+1 is now the step in flight; then launch N+2's
     forward right behind it, its decoding rows' input ids gathered from N+1's sampled tokens on
     the device. With a grammar, the device thus runs N+2's forward while the host accepts N+1's
     tokens and fills N+2's masks, instead of waiting for the host to plan N+2 first.
     Exception: when N+1 has grammar rows and N+2 is an eager (not CUDA-graph) forward, whose launch
     alone takes tens of ms of host time, N+2's launch waits for the next iteration, where N+1's
     tokens are read, accepted and N+2's masks started BEFORE the launch, so the fill runs during
     it (`_grammar_first`).

Invariants: (a) at most one step is in flight, and a sequence holds at most one placeholder;
(b) every host decision that depends on a token VALUE (finishing, grammar masks, min_tokens bans,
block hashes for prefix sharing) is taken after that token was read: scheduling only uses token
COUNTS, and a step is scheduled with at most the step before it unread (N+2 is planned after N was
read, before N+1 is even sampled); (c) a sequence that finished in step N (EOS, stop string,
grammar) may still hold a row of N+1 whose forward was launched before N was read: that row is
wasted work, its token is never read, and complete_step skips it. Its blocks are freed when N is read, after N+1's forward was queued: all
device work runs in order on one stream, so N+1's write into a freed block lands before any later
step (the earliest that can reuse the block) writes or reads it, and a freed block is never shared
(its prefix hash is dropped). A sequence preempted while N is in flight is likewise safe: N's KV
writes precede, on the stream, those of the step that reuses its blocks; its token is still read
and appended (it may finish while waiting). (d) `overlap=False` runs the same code but reads each
step's tokens right after launching it: the old serial loop, used by tests as the reference.
"""


from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchinfer.engine.config import EngineConfig
from batchinfer.engine.detokenizer import IncrementalDetokenizer
from batchinfer.engine.finish import append_token, make_result
from batchinfer.engine.grammar import GrammarState, StartedFill, Verdict
from batchinfer.engine.kv_cache import BlockAllocator
from batchinfer.engine.lanes import Lanes
from batchinfer.engine.model_runner import ModelRunner
from batchinfer.engine.prefill_policy import make_prefill_policy
from batchinfer.engine.request import Request, Result
from batchinfer.engine.sampled_tokens import SampledTokens
from batchinfer.engine.scheduler import ScheduledStep, Scheduler, SchedulerConfig
from batchinfer.engine.sequence import PENDING_TOKEN, Sequence, SequenceStatus
from batchinfer.engine.speculative import Drafter, SpecCounts, Speculator, spec_fields
from batchinfer.engine.stats import StepStats
from batchinfer.engine.step_cost import StepCost, device_ceilings
from batchinfer.models.loader import load_tokenizer


@dataclass(frozen=True)
class _Read:
    """The in-flight step's tokens, read and fed to the grammars, not yet applied to the sequences."""

    now: float
    rows: list[tuple[Sequence, int]]  # (sequence, token) of every row whose token is used
    verdicts: list[Verdict]  # the grammar's verdict per row (GrammarState.accept)
    fill: StartedFill | None  # masks of the next step's rows, started
    logprobs: Any = None  # the step's engine.logprobs.StepLogprobs, when some row asked


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet.

    sampling[i] is the sequence of sampled row i (rows of sequences that had already finished when
    it launched are wasted: their tokens are never read). marks: CUDA timing events (None on the
    CPU) at (end of the step before, start, end of forward, start of sampling); tokens.event ends it.
    """

    step: ScheduledStep
    sampling: list[Sequence]
    tokens: SampledTokens
    marks: tuple[Any, Any, Any, Any]


@dataclass
class _Planned:
    """A scheduled and packed step, its forward maybe not launched yet.

    pending: the sampled tokens its decoding rows read their input ids from, once known; forward:
    (logits, end of the step before, start, end of forward) timing marks, once launched."""

    step: ScheduledStep
    sampling: list[Sequence]
    batch: Any
    pending: Any = None
    forward: tuple[Any, Any, Any, Any] | None = None


class Engine:
    """Offline generation over a stream of requests with continuous batching."""

    def __init__(
        self,
        config: EngineConfig,
        on_step: Callable[[StepStats], None] | None = None,
        drafter: Drafter | None = None,
        *,
        tokenizer: Any = None,
        grammar_compiler: Any = None,
    ) -> None:
        """drafter: with config.speculative, draft tokens come from it instead of n-gram lookup
        (engine/speculative.py Drafter; the bench's oracle).
        tokenizer / grammar_compiler: the model's tokenizer and a structured.compiler.GrammarCompiler
        for it (this vocabulary, config.grammar_backend), or Futures of them, made elsewhere while the
        model loads (the job's preflight); None: the engine makes its own."""
        self.config = config
        self.on_step = on_step
        self.runner = ModelRunner(config)
        self.model_info = self.runner.info
        # per layer (k_scale, v_scale) of the FP8 KV cache when calibrated (kv_cache_scale auto), else None
        self.kv_scales = self.runner.kv_scales
        t = time.perf_counter()
        tokenizer = tokenizer.result() if isinstance(tokenizer, Future) else tokenizer
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(self.model_info.model_dir)
        # start-up phases (name, perf_counter start, end): the job's phase timer and `bench job` read them
        self.startup_spans = [*self.runner.startup_spans, ("tokenizer", t, time.perf_counter())]
        self.max_model_len = self.runner.max_model_len
        self.allocator = BlockAllocator(self.runner.num_blocks, config.block_size)
        sched_cfg = SchedulerConfig(
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_sharing=config.enable_prefix_sharing,
        )
        self.scheduler = Scheduler(sched_cfg, self.allocator, self._prefill_policy())
        self.eos_token_ids = frozenset(self.model_info.eos_token_ids)
        self.last_step: StepStats | None = None
        self._rng = random.Random(config.seed)
        self._next_id = 0
        self._num_steps = 0
        self._generating = False
        self._closed = False
        self.grammar = GrammarState(
            self.tokenizer, self.runner.vocab_size, config.grammar_backend, self.model_info.eos_token_ids,
            config.grammar_threads, config.max_num_seqs, pin_memory=self.runner.device.type == "cuda",
            compiler=grammar_compiler, share_masks=config.grammar_share_masks,
            mask_cache_bytes=config.grammar_mask_cache_mb << 20,
        )
        self._inflight: _InFlight | None = None
        self._planned: _Planned | None = None  # the next step, scheduled and packed while this one's masks fill
        self._last_end: Any = None  # timing event ending the last launched step (CUDA only)
        self._wait_s = 0.0  # host time blocked on the device in the current iteration
        self._idle_ms: float | None = None  # device idle gaps of the step read in this iteration
        self._phases: dict[str, float] = {}  # host ms by phase of the current iteration
        self._phase_t = 0.0
        self.speculator = (
            Speculator(config.speculative, self.runner.vocab_size, drafter, self.tokenizer)
            if config.speculative is not None else None
        )
        self._spec_counts: SpecCounts | None = None  # the current step's, when speculating
        # verify steps in two lanes, one's host work under the other's device work
        lanes = None if config.speculative is None else config.speculative.lanes
        if lanes is None:
            lanes = config.overlap and self.runner.device.type == "cuda"
        self._lanes = Lanes(self.speculator) if self.speculator is not None and lanes else None
        self._appended = 0  # output tokens appended to sequences so far (the speculation gate's measure)

    def _prefill_policy(self):
        """The scheduler's prefill policy by EngineConfig.prefill_policy; slack gets the step cost
        model of this model on this device and the mixed-step graph sizes, when those are captured."""
        c = self.config
        if c.prefill_policy == "budget":
            return make_prefill_policy("budget")
        runner = self.runner
        name = torch.cuda.get_device_name(runner.device) if runner.device.type == "cuda" else None
        kv_bytes = 1 if c.kv_cache_dtype == "fp8_e4m3" else torch.finfo(self.model_info.dtype).bits // 8
        cost = StepCost.for_model(self.model_info, device_ceilings(runner.device.type, name), kv_bytes)
        sizes = runner.mixed_graphs.sizes if runner.mixed_graphs is not None else None
        idle = c.slack_max_idle_slots if c.slack_max_idle_slots is not None else max(1, c.max_num_seqs // 32)
        return make_prefill_policy("slack", cost, tolerance=c.slack_tolerance, max_wait_steps=c.slack_max_wait_steps,
                                   max_idle_slots=idle, graph_sizes=sizes)

    # --- public API -------------------------------------------------------------------------

    @property
    def verify_lanes(self) -> bool:
        """Whether verify steps (speculative decoding) run in two lanes (engine/lanes.py)."""
        return self._lanes is not None

    def close(self) -> None:
        """Release the device memory now (CUDA graphs and their pools, KV cache, model) and the
        grammar threads. Idempotent; the engine cannot generate afterwards."""
        if self._generating:
            raise RuntimeError("Engine.close() while generate() is running; finish or close that iterator first")
        self._closed = True
        self._inflight = None
        self._planned = None
        self._last_end = None
        self.grammar.close()
        self.runner.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, requests: Iterable[Request]) -> Iterator[Result]:
        """Yield one Result per request, in finish order, pulling requests only as they are needed."""
        if self._closed:
            raise RuntimeError("this Engine was closed")
        if self._generating:
            raise RuntimeError("Engine.generate is already running; finish or close that iterator first")
        self._generating = True
        self._last_end = None
        source = iter(requests)
        exhausted = False
        try:
            while True:
                if not exhausted:
                    exhausted = yield from self._take_requests(source)
                if not self.scheduler.has_work() and self._inflight is None:
                    if exhausted:
                        return
                    continue
                yield from self._step()
        finally:
            self._abort_all()
            self._generating = False

    # --- arrival ----------------------------------------------------------------------------

    def _take_requests(self, source: Iterator[Request]) -> Generator[Result, None, bool]:
        """Take requests from `source` into the waiting queue for this loop iteration's step; yields
        the ones that can never run (error results); returns whether `source` is exhausted.

        The queue is kept at up to 2 x max_num_seqs, but filled a little per iteration
        (max_num_seqs // 8 requests, while the step launched before runs on the device) and beyond
        that only as far as the next step can admit (its token budget or its free sequence slots):
        taking all 512 before the first step cost a job ~0.9 s before its first step (H200,
        BENCHMARKS.md), for a first step that admits a handful of long prompts."""
        c, waiting = self.config, self.scheduler.waiting
        per_step = max(1, c.max_num_seqs // 8)
        queued: int | None = None  # prompt tokens waiting, counted once the per-step share is taken
        pulled = 0
        while len(waiting) < 2 * c.max_num_seqs:
            if pulled >= per_step:
                if queued is None:
                    queued = sum(s.num_tokens - s.num_computed_tokens for s in waiting)
                if queued >= c.max_num_batched_tokens or len(waiting) >= c.max_num_seqs - len(self.scheduler.running):
                    break
            try:
                request = next(source)
            except StopIteration:
                return True
            pulled += 1
            rejected = self._arrive(request)
            if rejected is not None:
                yield rejected
            elif queued is not None:
                queued += waiting[-1].num_tokens
        return False

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
            return make_result(seq)
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
            problem = self.grammar.attach(seq, constraint)
            if problem is not None:
                return f"request {rid}: {problem}"
        if seq.request.sampling.stop:
            skip = seq.request.sampling.skip_special_tokens
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, list(seq.token_ids), skip_special_tokens=skip)
        return None

    # --- one step ---------------------------------------------------------------------------

    def _step(self) -> list[Result]:
        """One loop iteration; returns the requests that finished. With speculation, a serial step
        with drafts (engine/speculative.py) where the gate (engine/spec_gate.py) measures that it
        pays, else a plain one."""
        spec = self.speculator
        if spec is None:
            return self._plain_step()
        gate = spec.gate
        # a step without room for drafts (decodes filling max_step_tokens, or with prefill_first prompts
        # filling the budget) would serially only be a plain step without the overlap (BENCHMARKS.md);
        # with SpeculativeConfig.lanes_drain off, lanes in flight carry it as a lane step without drafts
        lanes = self._lanes
        if not spec.has_room(self) and (lanes is None or spec.config.lanes_drain or not lanes.busy):
            if gate is not None:
                gate.passed()
            return (lanes.drain(self) if lanes is not None else []) + self._plain_step()
        t, rows, before = time.perf_counter(), len(self.scheduler.running), self._appended
        drafts = gate is None or gate.choose(rows)
        if drafts:
            results = self._plain_step(plan_ahead=False) if self._planned is not None else []  # sample the planned step
            results += self._read_inflight(None)[0] if self._inflight is not None else []  # (a plain step in flight)
            results += lanes.step(self) if lanes is not None else spec.step(self)
        else:
            results = (lanes.drain(self) if lanes is not None else []) + self._plain_step()
        if gate is not None:
            gate.record(rows, drafts, self._appended - before, time.perf_counter() - t)
        return results

    def _plain_step(self, plan_ahead: bool = True) -> list[Result]:
        """One loop iteration without drafts: sample step N+1 (launching its forward first if that
        has not happened yet), read and post-process step N, and plan step N+2 while N+1's masks
        fill (see the module docstring; plan_ahead=False: no N+2)."""
        t0 = self._begin_iteration()
        plan, self._planned = self._planned, None
        if plan is None:
            plan = self._plan(t0)
        step, sampling = plan.step, plan.sampling
        read: _Read | None = None
        if step.seqs and plan.forward is None:
            if self._grammar_first(plan.batch):
                read = self._read_and_accept(sampling)
            self._launch(plan, plan.pending)
        if read is None and self._inflight is not None:
            read = self._read_and_accept(sampling if step.seqs else None)
        results, fill = self._finish_read(read) if read is not None else ([], None)
        if step.seqs:
            self.scheduler.complete_step(step)
            live = [s.status is SequenceStatus.RUNNING for s in sampling]
            bans = [self._bans(s) if ok else [] for s, ok in zip(sampling, live)]
            counters = [s.num_generated for s in sampling]  # the sampler's per-row counters, before the placeholders
            for row, (seq, ok) in enumerate(zip(sampling, live)):
                if ok:
                    seq.token_ids.append(PENDING_TOKEN)
                    seq.pending_row = row
                    seq.final_pending = seq.num_generated >= seq.max_tokens or seq.num_tokens >= self.max_model_len
            self._phase("post")
            if self.config.overlap and plan_ahead:
                # plan N+2 now, while N+1's masks fill on the grammar threads: it is launched right
                # behind N+1's sampling below, so the device does not wait for the host's planning
                nxt = self._plan(time.perf_counter(), defer_gather=True)
                self._planned = nxt if nxt.step.seqs else None
            bitmask = self.grammar.bitmask(sampling, live, fill)
            self._phase("grammar_mask")
            sample_start = self.runner.mark()
            logits = plan.forward[0]
            if sampling:
                tokens = self._device_call(self.runner.sample_tokens, logits, sampling, bans, bitmask, counters)
            else:
                tokens = torch.empty(0, dtype=torch.int64, device=self.runner.device)
            logprobs = self.runner.token_logprobs(logits, sampling, tokens) if sampling else None
            self._phase("sample_launch")
            self._inflight = _InFlight(step, sampling, SampledTokens(tokens, logprobs), (*plan.forward[1:], sample_start))
            self._last_end = self._inflight.tokens.event
            nxt = self._planned
            if nxt is not None and not self._grammar_first(nxt.batch):
                self._launch(nxt, tokens)
            elif nxt is not None:
                nxt.pending = tokens  # launched after this step's tokens are read (_grammar_first)
            if not self.config.overlap:
                results += self._read_inflight(None)[0]
        self._report(step, t0, len(results))
        return results

    def _plan(self, now: float, defer_gather: bool = False) -> _Planned:
        """Schedule the next step and pack its inputs. defer_gather: the step whose sampled tokens
        its decoding rows read is not launched yet (they are gathered at _launch)."""
        step = self.scheduler.schedule()
        self._phase("schedule")
        for seq in step.seqs:
            if seq.scheduled is None:
                seq.scheduled = now
        sampling = [s for s, flag in zip(step.seqs, step.samples) if flag]
        batch = None
        pending = self._inflight.tokens.tensor if self._inflight is not None else None
        if step.seqs:
            batch = self.runner.prepare(step.seqs, step.num_tokens, step.samples, defer_gather=True)
            self._phase("prepare")
        return _Planned(step, sampling, batch, None if defer_gather else pending)

    def _launch(self, plan: _Planned, pending: torch.Tensor | None) -> None:
        """Queue the planned step's forward: its waiting input ids from `pending` (the sampled
        tokens of the step before it), then the model. Its logits and timing marks go on the plan."""
        start = self.runner.mark()
        self.runner.gather_pending(plan.batch, pending)
        logits = self._device_call(self.runner.forward, plan.batch)
        plan.forward = (logits, self._last_end, start, self.runner.mark())
        self._phase("launch")

    def _begin_iteration(self) -> float:
        """Start one loop iteration's accounting (its phases, the host's waits, the device's idle gaps:
        StepStats); returns its start time."""
        t0 = time.perf_counter()
        self._wait_s, self._idle_ms = 0.0, None
        self._phases, self._phase_t = {}, t0
        return t0

    def _phase(self, name: str) -> None:
        """Charge the host time since the last mark to phase `name` of this iteration (StepStats.phases_ms)."""
        now = time.perf_counter()
        self._phases[name] = self._phases.get(name, 0.0) + (now - self._phase_t) * 1000.0
        self._phase_t = now

    def _device_call(self, fn, *args):
        """Call a device-launching function; on the CPU its (synchronous) run counts as waiting."""
        if self.runner.device.type != "cpu":
            return fn(*args)
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self._wait_s += time.perf_counter() - t

    def _grammar_first(self, batch) -> bool:
        """Whether to read the in-flight step and start the next masks BEFORE launching this forward.

        Normally the forward goes first (the device gets work at once, the grammar work hides under
        it). An eager forward (a mixed or prefill step: no CUDA graph) costs ~25-30 ms of host time
        just to launch on an H200 (qwen3-0.6b, 8k tokens); with grammar rows in flight the mask fill
        then had to follow that launch and the host, not the device, set the step time (BENCHMARKS.md,
        docs1000-json). Started first, the fill runs on the library's threads during the launch."""
        flight = self._inflight
        return (
            flight is not None
            and self.grammar.in_use
            and any(s.matcher is not None for s in flight.sampling)
            and not self.runner.uses_graph(batch)
        )

    def _read_inflight(self, next_sampling: list[Sequence] | None) -> tuple[list[Result], StartedFill | None]:
        """Wait for the in-flight step's tokens, append them, finish the sequences they end
        (_read_and_accept, then _finish_read). Returns the finished requests and the started fill."""
        return self._finish_read(self._read_and_accept(next_sampling))

    def _read_and_accept(self, next_sampling: list[Sequence] | None) -> "_Read":
        """First half of reading the in-flight step: wait for its tokens, feed them to the grammars
        (one batched accept per library), and (next_sampling given: the sampling rows of the step
        being launched) start those rows' masks (on a helper thread where the library allows it), so
        that they fill while the rest runs. Sequences are not touched yet (see _finish_read)."""
        flight, self._inflight = self._inflight, None
        t = time.perf_counter()
        self._phase("post")  # (the work of this iteration before the read: bookkeeping)
        tokens = flight.tokens.tolist()
        self._wait_s += time.perf_counter() - t
        self._phase("read_tokens")
        self._idle_ms = self._idle_gaps_ms(flight.marks)
        now = time.perf_counter()
        # rows of sequences that had finished before this step launched are wasted: never read
        rows = [(seq, token) for row, (seq, token) in enumerate(zip(flight.sampling, tokens))
                if seq.pending_row == row and not seq.is_finished]
        verdicts = self.grammar.accept(rows)
        self._phase("grammar_accept")
        fill = self.grammar.start_fill(next_sampling, rows, verdicts) if next_sampling else None
        self._phase("grammar_fill_start")
        return _Read(now, rows, verdicts, fill, flight.tokens.logprobs)

    def _finish_read(self, read: "_Read") -> tuple[list[Result], StartedFill | None]:
        """Second half: swap each placeholder for its token, check stops, finish sequences."""
        now, rows, verdicts, fill = read.now, read.rows, read.verdicts, read.fill
        results = []
        self._appended += len(rows)
        for (seq, token), verdict in zip(rows, verdicts):
            seq.token_ids.pop()  # the placeholder
            if read.logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(read.logprobs.entry(seq.pending_row, token))
            seq.pending_row, seq.final_pending = None, False
            if append_token(seq, token, now, verdict, self.eos_token_ids, self.max_model_len, self.tokenizer):
                self.scheduler.finish(seq)
                results.append(make_result(seq))
        return results, fill

    @staticmethod
    def _idle_gaps_ms(marks: tuple[Any, Any, Any, Any]) -> float | None:
        """How long the GPU sat idle waiting for the host around a step whose tokens were read: from
        the end of the step launched before it to its start, and between its forward and its sampling
        (marks: those CUDA events; a plain step's, or a verify step's, engine/speculative.py). None on
        the CPU."""
        before, start, forward_end, sample_start = marks
        if start is None:
            return None
        gap = before.elapsed_time(start) if before is not None else 0.0
        return gap + forward_end.elapsed_time(sample_start)

    def _bans(self, seq: Sequence) -> list[int]:
        """Tokens that may not end the output yet (min_tokens)."""
        return self._bans_at(seq, seq.num_generated)

    def _bans_at(self, seq: Sequence, num_generated: int) -> list[int]:
        """Tokens that may not be the output token after `num_generated` ones (min_tokens)."""
        p = seq.request.sampling
        if num_generated >= p.min_tokens:
            return []
        ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        return sorted(i for i in ids if 0 <= i < self.runner.vocab_size)

    def _report(self, step: ScheduledStep, t0: float, num_finished: int) -> None:
        """StepStats of one iteration. schedule_ms is the host work the device did not hide: on a GPU
        the device's measured idle gaps around the step read in this iteration (the one before, with
        overlap); on the CPU all host work (the CPU is the device, nothing overlaps)."""
        self._num_steps += 1
        end = time.perf_counter()
        step_ms = (end - t0) * 1000.0
        wait_ms = self._wait_s * 1000.0
        host_ms = step_ms - wait_ms
        exposed = host_ms if self._idle_ms is None else self._idle_ms
        stats = StepStats(
            step=self._num_steps,
            time=end,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=step.num_decode_tokens,
            num_draft_tokens=step.num_draft_tokens,
            num_context_tokens=step.num_context_tokens,
            kv_blocks_used=self.allocator.num_used,
            kv_blocks_free=self.allocator.num_free,
            num_preemptions=len(step.preempted),
            schedule_ms=exposed,
            step_ms=step_ms,
            num_finished=num_finished,
            host_ms=host_ms,
            wait_ms=wait_ms,
            phases_ms=self._phases,
            prefill_limited=step.prefill_limited,
            **(spec_fields(self._spec_counts) if self._spec_counts is not None else {}),
        )
        self._spec_counts = None
        self.last_step = stats
        if self.on_step is not None:
            self.on_step(stats)

    def _abort_all(self) -> None:
        """Drop every unfinished sequence (the caller stopped iterating): free all their blocks.

        A step still in flight is abandoned: its tokens are never read; later device work queues
        behind it on the stream, so freeing its blocks now is safe.
        """
        self._planned = None  # (its forward may be queued: later device work queues behind it)
        if self._lanes is not None:
            self._lanes.abandon()  # (likewise the verify steps in flight)
        if self._inflight is not None:
            for seq in self._inflight.sampling:
                if seq.pending_row is not None:
                    seq.token_ids.pop()
                    seq.pending_row, seq.final_pending = None, False
            self._inflight = None
        for seq in list(self.scheduler.running):
            self.scheduler.finish(seq)
        self.scheduler.waiting.clear()
