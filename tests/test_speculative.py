"""Speculative decoding on CPU: token-identical to plain decoding, KV allocator invariants after
rollbacks, and the draft proposers.

Random weights rarely agree with n-gram drafts, so most identity tests draft from an oracle: the
output of a plain run of the same requests, with a share of its tokens corrupted. Those drafts are
mostly right, so the accept, partial-accept and reject paths all run (checked by the step stats).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.engine.speculative import SpeculativeConfig, ngram_draft
from batchinfer.structured.base import Constraint
from batchinfer.structured.validate import validate_output

EXAMPLES = Path(__file__).resolve().parent.parent / "schemas" / "examples"


def make_engine(path, speculative=None, on_step=None, drafter=None, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 256)
    kw.setdefault("block_size", 8)
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", speculative=speculative, **kw)
    return Engine(cfg, on_step=on_step, drafter=drafter)


def oracle(truth: dict[str, list[int]], corrupt: float, vocab: int, seed: int = 0):
    """Drafts = each request's recorded output from where the sequence is, a share corrupted."""
    rng = random.Random(seed)

    def draft(seq, k: int) -> list[int]:
        out = truth[seq.request.request_id][seq.num_generated : seq.num_generated + k]
        return [(t + 1 + rng.randrange(vocab - 1)) % vocab if rng.random() < corrupt else t for t in out]

    return draft


def run(engine: Engine, requests) -> dict:
    results = list(engine.generate(requests))
    ids = [r.request_id for r in results]
    assert len(ids) == len(set(ids)) == len(requests), "a request finished twice or never"
    engine.allocator.check()
    assert engine.allocator.num_used == 0, "KV blocks leaked"
    assert not engine.scheduler.running and not engine.scheduler.waiting
    return {r.request_id: r for r in results}


def assert_same(plain: dict, spec: dict) -> None:
    assert plain.keys() == spec.keys()
    for rid, a in plain.items():
        b = spec[rid]
        assert b.output_token_ids == a.output_token_ids, rid
        assert (b.finish_reason, b.text, b.error) == (a.finish_reason, a.text, a.error), rid


def check_step_limits(engine: Engine) -> None:
    """Make every step the engine schedules assert the scheduler's limits: its tokens (drafts counted)
    within max_num_batched_tokens, no more than max_num_seqs sequences running; and, in a step with
    drafts, every one-token row ahead of the longer ones (the attention backend's decode kernel takes
    the leading one-token rows)."""
    sched, schedule = engine.scheduler, engine.scheduler.schedule
    budget, seats = sched.config.max_num_batched_tokens, sched.config.max_num_seqs

    def checked(lane=None):
        step = schedule() if lane is None else schedule(lane)
        assert sum(step.num_tokens) == step.total_tokens <= budget, (step.num_tokens, step.total_tokens)
        assert sum(1 for q in sched.running if not q.final_pending) <= seats
        if step.num_draft_tokens:
            singles = [n == 1 for n in step.num_tokens]
            assert singles == sorted(singles, reverse=True), step.num_tokens
        return step

    sched.schedule = checked


def rand_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def plain_and_oracle(path, reqs, corrupt, method="ngram", lanes=False, **kw):
    """Plain outputs, outputs with oracle drafts (verify steps serial, or in two lanes), their steps."""
    plain = run(make_engine(path, **kw), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []
    engine = make_engine(path, {"method": method, "num_tokens": 4, "lanes": lanes}, on_step=steps.append,
                         drafter=oracle(truth, corrupt, 500), **kw)
    return plain, run(engine, reqs), steps


# --- the proposer ------------------------------------------------------------------------------


def reference_draft(tokens: list[int], sizes, k: int) -> list[int]:
    for n in sizes:
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i : i + n] == suffix:
                return tokens[i + n : i + n + k]
    return []


def test_ngram_draft_copies_what_followed():
    toks = np.array([1, 2, 3, 4, 5, 9, 2, 3], dtype=np.int64)
    assert ngram_draft(toks, (3, 2, 1), 3).tolist() == [4, 5, 9]
    assert ngram_draft(toks, (3,), 3).tolist() == []  # (9, 2, 3) never occurred before
    assert ngram_draft(np.array([7, 7, 7, 7]), (2,), 5).tolist() == [7]  # most recent occurrence
    assert ngram_draft(np.array([1, 2]), (3, 2, 1), 4).tolist() == []


@given(st.lists(st.integers(0, 4), min_size=0, max_size=40), st.integers(1, 6),
       st.lists(st.integers(1, 4), min_size=1, max_size=3, unique=True))
@settings(max_examples=200, deadline=None)
def test_ngram_draft_matches_reference(tokens, k, sizes):
    sizes = sorted(sizes, reverse=True)
    assert ngram_draft(np.array(tokens, dtype=np.int64), sizes, k).tolist() == reference_draft(tokens, sizes, k)


def test_config_checks_and_dict_form():
    cfg = EngineConfig(model="m", speculative={"method": "ngram+grammar", "num_tokens": 3, "ngram_sizes": [1, 3]})
    assert cfg.speculative == SpeculativeConfig("ngram+grammar", 3, (3, 1))
    assert EngineConfig(model="m").speculative is None
    with pytest.raises(ValueError, match="speculative.method"):
        SpeculativeConfig("eagle")
    with pytest.raises(ValueError, match="num_tokens"):
        SpeculativeConfig(num_tokens=0)


# --- token identity ------------------------------------------------------------------------------


LANES = pytest.mark.parametrize("lanes", [False, True], ids=["serial", "lanes"])


@LANES
def test_oracle_drafts_same_tokens_greedy_and_seeded(tiny_model, lanes):
    corrupt = 0.3
    rng = random.Random(1)
    reqs = [Request(f"r{i}", rand_prompt(rng, 4 + 9 * i), SamplingParams(max_tokens=18, temperature=t, seed=i, ignore_eos=True))
            for i, t in enumerate([0.0, 0.8, 0.0, 1.2])]
    reqs.append(Request("topk", rand_prompt(rng, 7), SamplingParams(max_tokens=15, temperature=0.9, top_k=20, top_p=0.9, seed=4)))
    reqs.append(Request("minp", rand_prompt(rng, 5), SamplingParams(max_tokens=15, temperature=1.0, min_p=0.05, seed=5, min_tokens=9)))
    reqs.append(Request("lp", rand_prompt(rng, 6), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)))
    plain, spec, steps = plain_and_oracle(tiny_model, reqs, corrupt, lanes=lanes)
    assert_same(plain, spec)
    # same tokens; values within float32 noise (the verify step's matmuls have other shapes)
    assert len(spec["lp"].logprobs) == 8
    for x, y in zip(spec["lp"].logprobs, plain["lp"].logprobs):
        assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    accepted = sum(s.spec_accepted for s in steps)
    verified = sum(s.spec_verified for s in steps)
    assert accepted > 0 and verified > accepted * (1.0 if corrupt == 0 else 1.05) - 1e-9
    # fewer target forwards than tokens: several tokens per decoding step
    emitted = sum(s.spec_emitted for s in steps)
    assert emitted > sum(s.spec_decode_rows for s in steps)


@LANES
def test_stops_min_tokens_and_chunked_prefill(tiny_model, lanes):
    rng = random.Random(2)
    base = [Request(f"p{i}", rand_prompt(rng, n), SamplingParams(max_tokens=16, temperature=t, seed=i, ignore_eos=True))
            for i, (n, t) in enumerate([(3, 0.0), (40, 0.9), (17, 1.0)])]
    free = run(make_engine(tiny_model), base)
    reqs = list(base)
    for i, r in enumerate(base):
        out, text = free[r.request_id].output_token_ids, free[r.request_id].text
        reqs.append(Request(f"id{i}", r.prompt_token_ids, replace(r.sampling, stop_token_ids=(out[5],))))
        reqs.append(Request(f"min{i}", r.prompt_token_ids, replace(r.sampling, stop_token_ids=(out[1],), min_tokens=7)))
        if len(text) > 8:
            reqs.append(Request(f"str{i}", r.prompt_token_ids, replace(r.sampling, stop=(text[4:7],))))
    plain, spec, steps = plain_and_oracle(tiny_model, reqs, 0.2, lanes=lanes, max_num_batched_tokens=48, max_num_seqs=5)
    assert_same(plain, spec)
    assert sum(s.spec_accepted for s in steps) > 0
    assert any(s.num_prefill_tokens and s.spec_verified for s in steps), "no step mixed prefill with drafts"


@LANES
@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-first", "drafts-first"])
def test_verify_steps_while_prompts_wait(tiny_model, lanes, prefill_first):
    """prefill_first: while waiting prompts fill a step's token budget there is no room for drafts:
    those steps run the plain (overlapped) loop, not a verify step without drafts. Drafts first (the
    default): the decoding sequences' drafts take their part of the budget while prompts still wait,
    and the prompts are admitted into the rest. The tokens stay the same either way."""
    rng = random.Random(4)
    reqs = [Request(f"r{i}", rand_prompt(rng, 30), SamplingParams(max_tokens=5 + 4 * (i % 4), temperature=0.0,
                                                                ignore_eos=True))
            for i in range(8)]  # they finish at different steps: prompts are admitted beside decodes
    plain = run(make_engine(tiny_model, max_num_batched_tokens=40, max_num_seqs=4), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []
    engine = make_engine(tiny_model, {"method": "ngram", "num_tokens": 4, "lanes": lanes, "prefill_first": prefill_first},
                         drafter=oracle(truth, 0.0, 500), max_num_batched_tokens=40, max_num_seqs=4, on_step=steps.append)
    spec, budgets = engine.speculator, []
    launch = spec.launch

    def launch_verify(eng, lane=None):
        budgets.append((spec._draft_budget(eng, lane), len(eng.scheduler.waiting)))
        return launch(eng, lane)

    spec.launch = launch_verify
    check_step_limits(engine)  # drafts count against the token budget: admitted prompts take the rest
    assert_same(plain, run(engine, reqs))
    assert budgets and all(b > 0 for b, _ in budgets), budgets
    assert any(w == 0 for _, w in budgets)  # verify steps ran once the prompts were in
    mixed = sum(1 for s in steps if s.num_prefill_tokens and s.spec_verified)  # steps that prefilled and verified
    assert mixed > 0 if not prefill_first else mixed == 0, (mixed, budgets)


@pytest.mark.parametrize("mode", ["serial", "lanes-drain", "lanes-carry"])
def test_prefill_beside_verify_steps(tiny_model, mode):
    """Prompts longer than the token budget, admitted beside decoding sequences: some steps hold only
    prefill chunks and sample nothing. A verify step of those once never completed, so the same chunk
    ran forever (lane steps carrying prefill: a lane's draft budget counts its own sequences only, so
    such a step can be a verify step). With prefill_first, where prefill leaves no room for drafts a
    serial engine and lanes_drain (the default) run plain overlapped steps; lanes_drain off carries
    that prefill in lane steps without drafts and runs no plain step. The tokens are the plain
    engine's in every mode."""
    rng = random.Random(5)
    reqs = [Request(f"r{i}", rand_prompt(rng, 60 + 7 * i), SamplingParams(max_tokens=6 + 3 * (i % 5), temperature=0.0,
                                                                       ignore_eos=True))
            for i in range(10)]
    plain = run(make_engine(tiny_model, max_num_batched_tokens=48, max_num_seqs=4), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []

    def on_step(stats) -> None:
        steps.append(stats)
        assert len(steps) < 500, "the engine stopped making progress (a prefill chunk repeated)"

    engine = make_engine(tiny_model, {"method": "ngram", "num_tokens": 4, "lanes": mode.startswith("lanes"),
                                      "lanes_drain": mode == "lanes-drain", "max_step_tokens": 40,
                                      "prefill_first": True},
                         drafter=oracle(truth, 0.0, 500), max_num_batched_tokens=48, max_num_seqs=4, on_step=on_step)
    plain_steps, no_room = [], []
    plain_step, has_room = engine._plain_step, engine.speculator.has_room

    def count_plain(*a, **k):
        plain_steps.append(1)
        return plain_step(*a, **k)

    drains: list[bool] = []  # per drain of the lanes: whether a lane had a step in flight
    if engine._lanes is not None:
        drain = engine._lanes.drain

        def count_drain(eng):
            drains.append(engine._lanes.busy)
            return drain(eng)

        engine._lanes.drain = count_drain

    def count_room(eng):
        room = has_room(eng)
        no_room.append(not room)
        return room

    engine._plain_step, engine.speculator.has_room = count_plain, count_room
    assert_same(plain, run(engine, reqs))
    assert any(no_room), "the workload never left a step without room for drafts"
    assert sum(s.spec_accepted for s in steps) > 0
    if mode == "lanes-carry":
        assert not any(drains), f"{sum(drains)} drains: the lanes drained for prefill"
        assert any(s.num_prefill_tokens and not s.num_decode_tokens for s in steps), "no lane step carried prefill alone"
    else:
        assert plain_steps, "no plain step while prefill left no room for drafts"
        assert mode != "lanes-drain" or any(drains), "the lanes never drained"


@LANES
@pytest.mark.parametrize(
    "config",
    [dict(num_kv_blocks=14, block_size=4, max_num_batched_tokens=8, max_num_seqs=3)],
)
def test_preemption_and_rollback_keep_the_allocator_sound(tiny_model, config, lanes):
    rng = random.Random(3)
    reqs = [Request(f"p{i}", rand_prompt(rng, n), SamplingParams(max_tokens=16, temperature=[0.0, 0.8][i % 2], seed=i, ignore_eos=i != 3))
            for i, n in enumerate((20, 31, 12, 9))]

    def eager(engine: Engine) -> Engine:
        engine.scheduler.config = replace(engine.scheduler.config, max_reserved_output=0)
        return engine

    plain = run(eager(make_engine(tiny_model, **config)), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []
    engine = eager(make_engine(tiny_model, {"num_tokens": 4, "lanes": lanes}, on_step=steps.append,
                               drafter=oracle(truth, 0.25, 500), **config))
    checks = []
    original = engine.scheduler.complete_step

    def checked(step):
        original(step)
        engine.allocator.check()
        for seq in engine.scheduler.running:
            # no drafts between a sequence's steps (with lanes, the other lane's step in flight has
            # its drafts); KV never ahead of tokens
            assert seq.num_draft == 0 or (lanes and seq not in step.seqs)
            assert seq.num_computed_tokens <= seq.num_tokens - seq.num_draft
            assert seq.num_registered_blocks * engine.allocator.block_size <= seq.num_computed_tokens
        checks.append(1)

    engine.scheduler.complete_step = checked
    spec = run(engine, reqs)
    assert_same(plain, spec)
    assert checks and sum(s.spec_accepted for s in steps) > 0
    assert sum(r.num_preemptions for r in spec.values()) > 0, "the tiny cache never forced a preemption"


@LANES
def test_prefix_sharing_hashes_only_emitted_tokens(tiny_model, lanes):
    """n answers of one prompt share its blocks; their outputs (drafts rejected mid-block) stay identical."""
    rng = random.Random(4)
    prompt = rand_prompt(rng, 37)
    reqs = [Request(f"n{i}", prompt, SamplingParams(max_tokens=20, temperature=0.9, seed=i, ignore_eos=True)) for i in range(4)]
    reqs += [Request("late", prompt + [5, 6], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    plain, spec, steps = plain_and_oracle(tiny_model, reqs, 0.5, lanes=lanes, block_size=4)
    assert_same(plain, spec)


@given(st.integers(0, 10_000), st.floats(0.0, 0.6), st.booleans())
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_random_workloads_same_tokens(tiny_model, seed, corrupt, lanes):
    """Random requests, batch limits and budget orders: the tokens are the plain engine's, and every
    step keeps the scheduler's limits (token budget with drafts counted, max_num_seqs running; both
    were broken once with lanes and drafts beside prefill)."""
    rng = random.Random(seed)
    reqs = [Request(f"h{i}", rand_prompt(rng, rng.randrange(1, 30)),
                    SamplingParams(max_tokens=rng.randrange(1, 14), temperature=rng.choice([0.0, 0.0, 0.7, 1.0]),
                                   seed=rng.randrange(100), ignore_eos=rng.random() < 0.7))
            for i in range(rng.randrange(1, 10))]
    limits = {"max_num_seqs": rng.choice([2, 3, 4, 256]), "max_num_batched_tokens": rng.choice([16, 24, 64, 2048])}
    plain = run(make_engine(tiny_model, **limits), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    engine = make_engine(tiny_model, {"method": "ngram", "num_tokens": 4, "lanes": lanes,
                                      "prefill_first": rng.random() < 0.3, "lanes_drain": rng.random() < 0.7},
                         drafter=oracle(truth, corrupt, 500), **limits)
    check_step_limits(engine)
    assert_same(plain, run(engine, reqs))


@pytest.mark.parametrize("backend,method", [("llguidance", "ngram+grammar"), ("xgrammar", "grammar")])
def test_json_schema_same_tokens_and_valid(tiny_model, backend, method):
    names = ["enum_const", "bounded_numbers", "optional_fields", "flat_object"]
    constraints = [Constraint.json_schema(json.loads((EXAMPLES / f"{n}.json").read_text())) for n in names]
    constraints += [Constraint.regex(r"[A-Z]{2}-[0-9]{3}"), Constraint.choice(["yes", "no", "maybe"])]
    reqs = [Request(f"g{i}", [5 + i, 40, 77], SamplingParams(max_tokens=60, temperature=[1.0, 0.0][i % 2], seed=i), constraints[i])
            for i in range(6)]
    reqs += [Request("u", [9, 8], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))]
    by_id = {r.request_id: r for r in reqs}
    plain = run(make_engine(tiny_model, grammar_backend=backend), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    for drafter, lanes in ((None, False), (oracle(truth, 0.3, 500), False), (oracle(truth, 0.3, 500), True)):
        steps: list = []
        engine = make_engine(tiny_model, {"method": method, "num_tokens": 5, "lanes": lanes}, on_step=steps.append,
                             drafter=drafter, grammar_backend=backend)
        spec = run(engine, reqs)
        assert_same(plain, spec)
        assert sum(s.spec_accepted for s in steps) > 0, "no grammar-forced or oracle draft was accepted"
    stops = 0
    for rid, res in spec.items():
        if by_id[rid].constraint is not None and res.finish_reason == "stop":
            assert validate_output(by_id[rid].constraint, res.text)[1] is None, (rid, res.text)
            stops += 1
    assert stops >= 3


def test_ngram_drafts_accepted_where_the_model_copies(tiny_model):
    """Greedy decoding of a random model soon loops; once it does, n-gram drafts are right."""
    rng = random.Random(5)
    reqs = [Request(f"c{i}", rand_prompt(rng, 6) * 3, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(2)]
    plain = run(make_engine(tiny_model), reqs)
    steps: list = []
    spec = run(make_engine(tiny_model, {"method": "ngram", "num_tokens": 4}, on_step=steps.append), reqs)
    assert_same(plain, spec)
    assert sum(s.spec_drafted for s in steps) > 0
    assert sum(s.spec_accepted for s in steps) > 0, "n-gram drafts never accepted on looping greedy output"


def test_lanes_take_turns_with_the_other_lane_in_flight(tiny_model):
    """With lanes, verify steps alternate between the two halves of the running sequences: each step
    holds one lane's sequences only, and most launch while the other lane's step is in flight."""
    rng = random.Random(7)
    reqs = [Request(f"l{i}", rand_prompt(rng, 5 + i), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
            for i in range(8)]
    plain = run(make_engine(tiny_model), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    engine = make_engine(tiny_model, {"method": "ngram", "num_tokens": 4, "lanes": True}, drafter=oracle(truth, 0.2, 500))
    spec, lanes, seen = engine.speculator, engine._lanes, []
    launch = spec.launch

    def launch_lane(eng, lane=None):
        other_busy = lanes._flight[1 - lane] is not None
        verify = launch(eng, lane)
        seen.append((lane, {s.lane for s in verify.step.seqs}, len(verify.step.seqs), other_busy))
        return verify

    spec.launch = launch_lane
    assert_same(plain, run(engine, reqs))
    assert [lane for lane, *_ in seen[:6]] == [0, 1, 0, 1, 0, 1]
    assert all(lanes_in <= {lane} for lane, lanes_in, _, _ in seen), "a step held another lane's sequence"
    decode = [(n, busy) for _, _, n, busy in seen if n]
    assert max(n for n, _ in decode) == 4, "the 8 sequences were not split 4 and 4"
    assert sum(busy for _, busy in decode) > len(decode) / 2


def test_lanes_stay_even_when_one_lanes_sequences_finish_first(tiny_model):
    """Sequences finish unevenly: before a lane launches, its excess moves to the other lane, so no
    step holds more than half the running sequences (rounded up) and the tail still takes turns."""
    rng = random.Random(8)
    lengths = [6, 6, 6, 6, 40, 40, 40, 40]  # a lane admits four at a time: the short ones all sit in lane 0
    reqs = [Request(f"u{i}", rand_prompt(rng, 6), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            for i, n in enumerate(lengths)]
    plain = run(make_engine(tiny_model), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    engine = make_engine(tiny_model, {"method": "ngram", "num_tokens": 4, "lanes": True}, drafter=oracle(truth, 0.0, 500))
    spec, seen = engine.speculator, []
    launch = spec.launch

    def launch_lane(eng, lane=None):
        running = len(eng.scheduler.running)
        verify = launch(eng, lane)
        seen.append((len(verify.step.seqs), running))
        return verify

    spec.launch = launch_lane
    assert_same(plain, run(engine, reqs))
    assert all(n <= -(-running // 2) for n, running in seen[2:]), seen
    tail = [n for n, running in seen[2:] if running == 4]
    assert tail and max(tail) == 2, seen  # the four long answers' tail: two a step, lanes taking turns
