"""Overlap scheduling (one-step lookahead) on CPU: the same tokens as the serial loop, and the
scheduler / allocator invariants hold.

On the CPU the device is synchronous, but the overlap code path is the same one a GPU runs: step N+1
is scheduled and packed with placeholders for N's tokens, its decoding rows gather their input ids
from N's sampled-token tensor, and sequences finishing in N leave wasted rows in N+1. These tests
check that path against `overlap=False` (the serial loop, itself checked against transformers in
tests/test_engine.py).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.engine.sequence import PENDING_TOKEN
from batchinfer.structured.base import Constraint
from batchinfer.structured.validate import validate_output

EXAMPLES = Path(__file__).resolve().parent.parent / "schemas" / "examples"


def make_engine(path, overlap: bool, on_step=None, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 8)
    return Engine(EngineConfig(model=str(path), dtype="float32", device="cpu", overlap=overlap, **kw), on_step=on_step)


def watch(engine: Engine) -> dict[str, int]:
    """Count prepared batches that gather input ids from the in-flight step, placeholder ids that
    reached a launched step's input (there must be none), and the most sequences one step held."""
    counts = {"gathered": 0, "placeholders": 0, "max_rows": 0}
    prepare, gather = engine.runner.prepare, engine.runner.gather_pending

    def wrapped(seqs, num_tokens, samples, pending=None, **kw):
        batch = prepare(seqs, num_tokens, samples, pending, **kw)
        counts["max_rows"] = max(counts["max_rows"], len(seqs))
        counts["gathered"] += batch.gather_dst is not None
        return batch

    def gathered(batch, pending):
        gather(batch, pending)
        counts["placeholders"] += int((batch.input_ids == PENDING_TOKEN).sum())

    engine.runner.prepare = wrapped
    engine.runner.gather_pending = gathered
    return counts


def run_both(path, requests, setup=None, **kw) -> tuple[dict, dict, list[Engine], list[list]]:
    """Results by id with overlap off and on, the engines, and their step stats."""
    outs, engines, stats = [], [], []
    for overlap in (False, True):
        steps: list = []
        engine = make_engine(path, overlap, on_step=steps.append, **kw)
        if setup is not None:
            setup(engine)
        engine.counts = watch(engine)
        results = list(engine.generate(requests))
        ids = [r.request_id for r in results]
        assert len(ids) == len(set(ids)) == len(requests), "a request finished twice or never"
        engine.allocator.check()
        assert engine.allocator.num_used == 0, "KV blocks leaked"
        assert not engine.scheduler.running and not engine.scheduler.waiting
        assert engine.counts["placeholders"] == 0
        assert engine.counts["max_rows"] <= engine.config.max_num_seqs
        outs.append({r.request_id: r for r in results})
        engines.append(engine)
        stats.append(steps)
    serial, overlapped = outs
    assert engines[0].counts["gathered"] == 0, "the serial loop must never gather from an in-flight step"
    return serial, overlapped, engines, stats


def assert_same(serial: dict, overlapped: dict) -> None:
    assert serial.keys() == overlapped.keys()
    for rid, a in serial.items():
        b = overlapped[rid]
        assert b.output_token_ids == a.output_token_ids, rid
        assert (b.finish_reason, b.text, b.error) == (a.finish_reason, a.text, a.error), rid
        assert b.completion_tokens == a.completion_tokens and b.prompt_tokens == a.prompt_tokens


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def test_overlap_is_on_by_default_and_gathers_on_device(tiny_model):
    assert EngineConfig(model="m").overlap is True
    rng = random.Random(0)
    reqs = [Request(f"r{i}", rand_prompt(rng, 5 + 7 * i), SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
            for i in range(5)]
    serial, overlapped, engines, stats = run_both(tiny_model, reqs)
    assert_same(serial, overlapped)
    assert engines[1].counts["gathered"] > 5, "overlap never planned a step ahead of the tokens"
    # Length-only finishes are known before the token is read, so overlap wastes no rows at all.
    assert sum(s.num_decode_tokens for s in stats[0]) == sum(s.num_decode_tokens for s in stats[1])
    assert all(s.host_ms >= 0 and s.wait_ms >= 0 and s.schedule_ms >= 0 for s in stats[1])


def test_mixed_workload_same_tokens(tiny_model):
    """Chunked prefill, a shared prefix, stop strings, stop token ids (as EOS), min_tokens, greedy and
    seeded sampling: overlap on and off give identical results."""
    rng = random.Random(1)
    prefix = rand_prompt(rng, 24)
    prompts = [rand_prompt(rng, n) for n in (3, 40, 17)] + [prefix + rand_prompt(rng, n) for n in (2, 11, 5)]
    base = [SamplingParams(max_tokens=14, temperature=t, seed=i, ignore_eos=True)
            for i, t in enumerate([0.0, 0.9, 0.0, 0.7, 0.0, 1.0])]
    plain = [Request(f"p{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, base))]
    # Learn each request's free-running output, then stop it early by id, by string and with min_tokens.
    free = {r.request_id: r for r in make_engine(tiny_model, False).generate(plain)}
    reqs = list(plain)
    for i, r in enumerate(plain):
        out = free[r.request_id].output_token_ids
        reqs.append(Request(f"id{i}", r.prompt_token_ids, replace(r.sampling, stop_token_ids=(out[4],))))
        reqs.append(Request(f"min{i}", r.prompt_token_ids, replace(r.sampling, stop_token_ids=(out[1],), min_tokens=6)))
        text = free[r.request_id].text
        if len(text) > 6:
            reqs.append(Request(f"str{i}", r.prompt_token_ids, replace(r.sampling, stop=(text[3:6],))))
    serial, overlapped, engines, stats = run_both(tiny_model, reqs, max_num_batched_tokens=24, max_num_seqs=6)
    assert_same(serial, overlapped)
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats[1]), "no step mixed prefill and decode"
    assert any(s.num_prefill_tokens > 0 and s.num_prefill_tokens < 40 for s in stats[1])
    early = [r for r in overlapped.values() if r.finish_reason == "stop"]
    assert len(early) >= 8, "too few early stops to exercise wasted rows"
    for i in range(len(plain)):
        assert overlapped[f"min{i}"].completion_tokens >= 6
    # Rows of sequences that stopped on a token value were computed once more, never returned.
    assert sum(s.num_decode_tokens for s in stats[1]) > sum(s.num_decode_tokens for s in stats[0])


@pytest.mark.parametrize(
    "config",
    [
        dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=64),
        dict(num_kv_blocks=20, block_size=4, max_num_batched_tokens=8, max_num_seqs=3),
        dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=16, max_num_seqs=4),
    ],
)
def test_preemption_with_a_tiny_cache(tiny_model, config):
    rng = random.Random(2)
    prompts = [rand_prompt(rng, n) for n in (20, 31, 12, 26, 9)]
    reqs = [
        Request(f"p{i}", p, SamplingParams(max_tokens=16, temperature=[0.0, 0.8][i % 2], seed=i, ignore_eos=i != 3))
        for i, p in enumerate(prompts)
    ]

    def eager(engine: Engine) -> None:
        engine.scheduler.config = replace(engine.scheduler.config, max_reserved_output=0)

    serial, overlapped, engines, stats = run_both(tiny_model, reqs, setup=eager, **config)
    assert_same(serial, overlapped)
    assert sum(r.num_preemptions for r in overlapped.values()) > 0, "the tiny cache never forced a preemption"
    assert sum(s.num_preemptions for s in stats[1]) == sum(r.num_preemptions for r in overlapped.values())


@pytest.mark.parametrize("grammar_first", [True, False])
def test_grammar_constraints_same_tokens_and_valid(tiny_model, monkeypatch, grammar_first):
    """Same tokens as the serial loop, in both orders of an overlapped step with grammar rows in
    flight: masks started before the forward launch (eager steps, the CPU's only kind) or after it
    (CUDA-graph decode steps on a GPU)."""
    from batchinfer.engine.engine import Engine

    calls = []
    real = Engine._grammar_first

    def decide(self, batch):
        calls.append(real(self, batch))
        return grammar_first and calls[-1]

    monkeypatch.setattr(Engine, "_grammar_first", decide)
    names = ["enum_const", "bounded_numbers", "optional_fields"]
    constraints = [Constraint.json_schema(json.loads((EXAMPLES / f"{n}.json").read_text())) for n in names]
    constraints += [Constraint.regex(r"[A-Z]{2}-[0-9]{3}"), Constraint.choice(["yes", "no", "maybe"])]
    reqs = [
        Request(f"g{i}", [5 + i, 40, 77], SamplingParams(max_tokens=80, temperature=1.0, seed=i), constraints[i % 5])
        for i in range(6)
    ]
    reqs += [Request(f"u{i}", [9, 8 + i], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)) for i in range(3)]
    by_id = {r.request_id: r for r in reqs}
    serial, overlapped, _, _ = run_both(tiny_model, reqs)
    assert_same(serial, overlapped)
    stops = 0
    for rid, res in overlapped.items():
        if by_id[rid].constraint is not None and res.finish_reason == "stop":
            _, err = validate_output(by_id[rid].constraint, res.text)
            assert err is None, (rid, res.text, err)
            stops += 1
    assert stops >= 4
    assert any(calls), "no step had grammar rows in flight before an eager forward"


def test_abandoned_generate_frees_everything(tiny_model):
    """Stop iterating while a step is in flight: no block stays taken, and the engine runs again."""
    engine = make_engine(tiny_model, True)
    rng = random.Random(3)
    reqs = [Request(f"r{i}", rand_prompt(rng, 6 + i), SamplingParams(max_tokens=3 + 4 * i, temperature=0.0, ignore_eos=True))
            for i in range(6)]
    gen = engine.generate(reqs)
    first = next(gen)
    assert engine._inflight is not None and engine.scheduler.running
    gen.close()
    engine.allocator.check()
    assert engine.allocator.num_used == 0 and engine._inflight is None
    again = {r.request_id: r for r in engine.generate(reqs)}
    assert again[first.request_id].output_token_ids == first.output_token_ids
    assert len(again) == 6 and engine.allocator.num_used == 0


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(10, 40),
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 6),
)
def test_random_workloads_match_serial(tiny_model, seed, num_blocks, block_size, budget, max_seqs):
    rng = random.Random(seed)
    prefix = rand_prompt(rng, 10)
    reqs = []
    for i in range(rng.randint(1, 8)):
        prompt = rand_prompt(rng, rng.randint(1, 20))
        if rng.random() < 0.3:
            prompt = prefix + prompt
        max_tokens = rng.randint(1, 10)
        stop_ids = (rng.randrange(3, 500),) if rng.random() < 0.3 else ()
        sp = SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.8]), seed=i,
                            ignore_eos=rng.random() < 0.5, stop_token_ids=stop_ids, min_tokens=rng.randint(0, max_tokens))
        reqs.append(Request(f"r{i}", prompt, sp))
    # Requests too big for the cache get an error result in both modes.
    serial, overlapped, _, _ = run_both(
        tiny_model, reqs, num_kv_blocks=num_blocks, block_size=block_size,
        max_num_batched_tokens=budget, max_num_seqs=max_seqs,
    )
    assert_same(serial, overlapped)


def test_a_sequence_preempted_in_flight_can_finish_while_waiting(tiny_model):
    """With overlap, a sequence may be preempted while its last token is still in flight; reading
    that token then finishes it from the waiting queue (Scheduler.finish handles both queues)."""
    engine = make_engine(tiny_model, True, num_kv_blocks=8, block_size=4)
    sched = engine.scheduler
    seqs = []
    for i in range(2):
        engine._arrive(Request(f"r{i}", [7 + i] * 6, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)))
        seqs.append(sched.waiting[-1])
    step = sched.schedule()
    assert step.seqs == seqs
    sched.complete_step(step)
    victim = seqs[1]
    sched._preempt(victim, step)
    assert victim in sched.waiting and not victim.block_ids
    sched.finish(victim)
    sched.finish(seqs[0])
    assert not sched.waiting and not sched.running and victim.is_finished
    engine.allocator.check()
    assert engine.allocator.num_used == 0
