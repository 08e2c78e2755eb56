"""Scheduler under random request mixes, simulated without a model.

The simulation keeps a fake KV cache: each slot remembers which (prefix of tokens) wrote it. Every
step checks that each scheduled sequence's context is really in its blocks (so prefix sharing and
preemption/recompute never attend to the wrong KV), that shared blocks are never written, that the
token budget and sequence cap hold, and the allocator's invariants. At the end every request has
finished exactly once and no block is in use.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.kv_cache import BlockAllocator
from batchinfer.engine.request import Request, SamplingParams
from batchinfer.engine.scheduler import Scheduler, SchedulerConfig
from batchinfer.engine.sequence import Sequence, SequenceStatus


def make_seq(i: int, prompt: list[int], max_tokens: int) -> Sequence:
    req = Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens))
    return Sequence.from_request(i, req)


def assert_drained(sched: Scheduler, sim: Sim, seqs: list[Sequence], num_blocks: int) -> None:
    """After a simulation: every admitted sequence finished exactly once and gave back its blocks,
    the allocator is whole and consistent, nothing is left queued."""
    assert sorted(q.seq_id for q in sim.finished) == sorted(q.seq_id for q in seqs)
    assert all(q.is_finished and q.block_ids == [] for q in seqs)
    assert sched.allocator.num_free == num_blocks
    sched.allocator.check()
    assert not sched.waiting and not sched.running


class Sim:
    """Drives a scheduler like the engine does, checking invariants at every step."""

    def __init__(self, sched: Scheduler, rng: random.Random, eos_prob: float = 0.0) -> None:
        self.s = sched
        self.rng = rng
        self.eos_prob = eos_prob
        self.kv: dict[int, tuple[int, ...]] = {}
        self.finished: list[Sequence] = []
        self.steps = 0
        self.max_used = 0

    def slot(self, seq: Sequence, pos: int) -> int:
        bs = self.s.block_size
        return seq.block_ids[pos // bs] * bs + pos % bs

    def step(self) -> None:
        self.complete(self.launch())

    def launch(self, lane: int | None = None):
        """Schedule a step (of one lane's sequences, or all) and write its KV, checking the invariants."""
        s, a = self.s, self.s.allocator
        step = s.schedule() if lane is None else s.schedule(lane)  # (a subclass may wrap schedule())
        self.steps += 1
        assert step.total_tokens <= s.config.max_num_batched_tokens
        assert len(s.running) <= s.config.max_num_seqs
        assert sum(step.num_tokens) == step.total_tokens
        assert step.num_context_tokens == sum(q.num_computed_tokens + n for q, n in zip(step.seqs, step.num_tokens))
        assert len({id(q) for q in step.seqs}) == len(step.seqs)
        assert step.seqs or step.preempted or not s.has_work() or lane is not None, "no progress"  # (a lane may be empty)
        a.check()
        self.max_used = max(self.max_used, a.num_used)
        for seq, n in zip(step.seqs, step.num_tokens):
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            c = seq.num_computed_tokens
            assert len(seq.block_ids) * s.block_size >= c + n
            for pos in range(c):  # the context this step attends to
                assert self.kv[self.slot(seq, pos)] == tuple(seq.token_ids[: pos + 1]), "wrong KV in context"
            for pos in range(c, c + n):
                block = seq.block_ids[pos // s.block_size]
                assert a.refcounts[block] == 1, "writing into a shared block"
                self.kv[self.slot(seq, pos)] = tuple(seq.token_ids[: pos + 1])
        return step

    def complete(self, step) -> None:
        """Read a launched step: complete it, append the sampled tokens, finish some sequences."""
        s, a = self.s, self.s.allocator
        s.complete_step(step)
        a.check()
        for seq, sampled in zip(step.seqs, step.samples):
            if seq.status is not SequenceStatus.RUNNING:
                continue
            assert sampled == (seq.num_remaining == 0)
            if not sampled:
                continue
            seq.token_ids.append(self.rng.randrange(50))
            if seq.num_generated >= seq.max_tokens or self.rng.random() < self.eos_prob:
                s.finish(seq)
                self.finished.append(seq)

    def run(self, max_steps: int = 5000) -> None:
        while self.s.has_work():
            self.step()
            assert self.steps < max_steps, "scheduler does not make progress"


def build(num_blocks, block_size, max_seqs, budget, max_len=10_000, sharing=True, reserve=1024):
    cfg = SchedulerConfig(max_seqs, budget, max_len, sharing, max_reserved_output=reserve)
    return Scheduler(cfg, BlockAllocator(num_blocks, block_size))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    max_seqs=st.integers(1, 6),
    budget=st.integers(1, 48),
    num_reqs=st.integers(1, 12),
    sharing=st.booleans(),
    reserve=st.sampled_from([0, 2, 1024]),
    eos_prob=st.sampled_from([0.0, 0.2]),
)
def test_random_mix_all_finish_once_no_leak(
    seed, num_blocks, block_size, max_seqs, budget, num_reqs, sharing, reserve, eos_prob
):
    rng = random.Random(seed)
    sched = build(num_blocks, block_size, max_seqs, budget, sharing=sharing, reserve=reserve)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 20))] for _ in range(3)]
    sim = Sim(sched, rng, eos_prob)
    seqs, rejected = [], 0
    for i in range(num_reqs):
        prompt = rng.choice(prefixes)[: rng.randint(1, 20)] + [rng.randrange(50) for _ in range(rng.randint(0, 12))]
        seq = make_seq(i, prompt, rng.randint(1, 30))
        if sched.check(seq) is not None:
            rejected += 1
            assert -(-(len(prompt) + seq.max_tokens) // block_size) > num_blocks
            continue
        seqs.append(seq)
        sched.add(seq)
        if rng.random() < 0.3:  # requests also arrive while others run
            sim.step()
    sim.run()
    assert_drained(sched, sim, seqs, num_blocks)


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4]),
    max_seqs=st.integers(2, 6),
    budget=st.integers(2, 48),
    num_reqs=st.integers(1, 12),
    sharing=st.booleans(),
)
def test_lanes_never_touch_the_other_lane_in_flight(seed, num_blocks, block_size, max_seqs, budget, num_reqs, sharing):
    """Two lanes taking turns (engine/lanes.py): each step is scheduled while the other lane's step is
    in flight (launched, not yet read), with plain steps of every sequence in between (the engine
    drains both lanes first). A lane's step holds only its own sequences, admits into it, and never
    preempts or reallocates the other lane's; no more than max_num_seqs run at once; every request
    still finishes once, nothing leaks."""
    rng = random.Random(seed)
    sched = build(num_blocks, block_size, max_seqs, budget, sharing=sharing, reserve=0)
    sim = Sim(sched, rng, eos_prob=0.1)
    seqs = []
    for i in range(num_reqs):
        seq = make_seq(i, [rng.randrange(50) for _ in range(rng.randint(1, 16))], rng.randint(1, 12))
        if sched.check(seq) is None:
            seqs.append(seq)
            sched.add(seq)
    in_flight: list = [None, None]
    lane = 0
    while sched.has_work() or any(in_flight):
        if rng.random() < 0.2:  # the engine leaves the lanes for a plain step (both lanes read first)
            for k in (lane, lane ^ 1):
                if in_flight[k] is not None:
                    sim.complete(in_flight[k])
                    in_flight[k] = None
            sim.step()
            assert len(sched.running) <= max_seqs, "more sequences running than max_num_seqs"
            continue
        if in_flight[lane] is not None:
            sim.complete(in_flight[lane])
            in_flight[lane] = None
        others = {id(q): list(q.block_ids) for q in sched.running if q.lane != lane}
        step = sim.launch(lane)
        assert len(sched.running) <= max_seqs, "more sequences running than max_num_seqs"
        assert all(q.lane == lane for q in step.seqs), "a step held the other lane's sequence"
        assert not any(id(q) in others for q in step.preempted), "the other lane's sequence was preempted"
        assert {id(q): q.block_ids for q in sched.running if id(q) in others} == others, "the other lane's blocks moved"
        in_flight[lane] = step if step.seqs else None
        lane ^= 1
        assert sim.steps < 5000, "no progress"
    assert_drained(sched, sim, seqs, num_blocks)


def test_prefix_sharing_shares_blocks():
    sched = build(num_blocks=64, block_size=8, max_seqs=8, budget=1000)
    prefix = list(range(40))
    a = make_seq(0, prefix + [100, 101, 102], 4)
    b = make_seq(1, prefix + [200, 201], 4)
    sched.add(a)
    sim = Sim(sched, random.Random(0))
    sim.step()  # a's prompt is computed; its 5 full prefix blocks are published
    sched.add(b)
    step = sched.schedule()
    assert b in step.seqs
    assert b.block_ids[:5] == a.block_ids[:5]
    assert b.num_computed_tokens == 40 and step.num_tokens[step.seqs.index(b)] == 2
    assert sched.allocator.num_used == len(a.block_ids) + 1  # b owns only its last block
    assert all(sched.allocator.refcounts[x] == 2 for x in a.block_ids[:5])


def test_no_sharing_of_a_block_still_being_prefilled():
    sched = build(num_blocks=64, block_size=8, max_seqs=8, budget=12)
    prompt = list(range(30))
    a, b = make_seq(0, prompt, 2), make_seq(1, prompt, 2)
    sched.add(a)
    sched.add(b)
    sim = Sim(sched, random.Random(0))
    sim.run()  # the KV check in Sim fails if b ever attends over a block a had not written yet
    assert len(sim.finished) == 2


def test_fully_cached_prompt_still_computes_last_token():
    sched = build(num_blocks=64, block_size=4, max_seqs=8, budget=1000)
    prompt = list(range(16))
    a = make_seq(0, prompt + [99], 8)
    sched.add(a)
    sim = Sim(sched, random.Random(0))
    sim.step()
    b = make_seq(1, prompt, 8)
    sched.add(b)
    step = sched.schedule()
    i = step.seqs.index(b)
    assert b.num_computed_tokens == 12 and step.num_tokens[i] == 4 and step.samples[i]


def test_decodes_not_stalled_by_long_prefill():
    sched = build(num_blocks=200, block_size=4, max_seqs=4, budget=16)
    sim = Sim(sched, random.Random(0))
    short = make_seq(0, [1, 2, 3], 50)
    sched.add(short)
    sim.step()
    long_doc = make_seq(1, list(range(300)), 5)
    sched.add(long_doc)
    for _ in range(10):
        step = sched.schedule()
        assert short in step.seqs and step.num_tokens[step.seqs.index(short)] == 1
        assert step.total_tokens <= 16
        sched.complete_step(step)
        for seq, sampled in zip(step.seqs, step.samples):
            if sampled:
                seq.token_ids.append(7)
    assert 0 < long_doc.num_computed_tokens < 300  # chunked


def test_preemption_of_newest_and_recompute():
    # 6 blocks of 2 tokens; each sequence grows to 10 tokens (5 blocks); reservation capped at 0
    # output tokens so both get admitted and must fight for blocks.
    sched = build(num_blocks=6, block_size=2, max_seqs=4, budget=100, reserve=0)
    a, b = make_seq(0, [1, 2, 3, 4], 6), make_seq(1, [5, 6, 7, 8], 6)
    sched.add(a)
    sched.add(b)
    sim = Sim(sched, random.Random(0))
    sim.run()
    assert {q.seq_id for q in sim.finished} == {0, 1}
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert sched.num_preemptions == b.num_preemptions


def test_reservation_avoids_preemption():
    sched = build(num_blocks=6, block_size=2, max_seqs=4, budget=100)
    a, b = make_seq(0, [1, 2, 3, 4], 6), make_seq(1, [5, 6, 7, 8], 6)
    sched.add(a)
    sched.add(b)
    sim = Sim(sched, random.Random(0))
    sim.run()
    assert a.num_preemptions == b.num_preemptions == 0
    assert len(sim.finished) == 2


def test_impossible_requests_are_rejected_with_a_message():
    sched = build(num_blocks=4, block_size=4, max_seqs=4, budget=100, max_len=32)
    too_long = make_seq(0, list(range(30)), 5)
    assert "max_model_len" in sched.check(too_long)
    too_big = make_seq(1, list(range(10)), 10)
    assert "KV blocks" in sched.check(too_big)
    assert "empty" in sched.check(make_seq(2, [], 3))
    assert sched.check(make_seq(3, list(range(10)), 6)) is None


def test_max_num_seqs_caps_running():
    sched = build(num_blocks=100, block_size=4, max_seqs=2, budget=100)
    seqs = [make_seq(i, [i, i + 1], 3) for i in range(5)]
    for q in seqs:
        sched.add(q)
    sim = Sim(sched, random.Random(0))
    sim.run()
    assert len(sim.finished) == 5
