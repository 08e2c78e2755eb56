"""The speculation gate (engine/spec_gate.py): it runs the mode that measures the higher output
rate per batch size, probes the other, and switching modes mid-run keeps the output token-identical."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_speculative import (
    EXAMPLES,
    assert_same,
    make_engine,
    oracle,
    rand_prompt,
    run,
)

from batchinfer.engine import Request, SamplingParams
from batchinfer.engine.spec_gate import GateConfig, SpecGate, bucket_of
from batchinfer.structured.base import Constraint
from batchinfer.structured.validate import validate_output


def simulate(gate: SpecGate, rate, steps: int, rows: int = 100) -> list[bool]:
    """Run `steps` steps of `rows` sequences where a mode appends rate(mode, step) tokens per second."""
    chosen = []
    for i in range(steps):
        spec = gate.choose(rows)
        chosen.append(spec)
        gate.record(rows, spec, round(rate(spec, i) * 0.1), 0.1)  # 0.1 s steps: rates >= 100 keep 1% resolution
    return chosen


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 7, 8, 255, 256)] == [0, 0, 1, 1, 2, 2, 3, 7, 8]
    with pytest.raises(ValueError):
        GateConfig(probe_steps=1)


@given(st.floats(100, 10_000), st.floats(100, 10_000))
@settings(max_examples=60, deadline=None)
def test_the_faster_mode_runs_most_steps(plain, spec):
    """After trying both, the gate spends all but its probes on the faster mode."""
    if max(plain, spec) < 1.05 * min(plain, spec):
        return  # a near tie: either is right
    cfg = GateConfig(probe_interval=32, probe_steps=4)
    chosen = simulate(SpecGate(cfg), lambda s, _i: spec if s else plain, 640)
    faster = spec > plain
    late = chosen[64:]
    share = sum(c == faster for c in late) / len(late)
    assert share >= 1 - cfg.probe_steps / cfg.probe_interval - 0.02


def test_a_change_of_rates_is_followed():
    """Speculation stops paying half-way (contexts grew): the probes see it and the gate switches."""
    chosen = simulate(SpecGate(GateConfig(probe_interval=16, probe_steps=3)), lambda s, i: (3000 if i < 300 else 800) if s else 1500, 600)
    assert sum(chosen[100:300]) / 200 > 0.7
    assert sum(chosen[450:]) / 150 < 0.3


def test_buckets_choose_apart():
    """Small batches speculate, large ones do not, in the same run."""
    gate = SpecGate(GateConfig(probe_interval=16, probe_steps=2))
    for i in range(400):
        rows = 4 if i % 2 else 200
        spec = gate.choose(rows)
        faster = rows == 4
        gate.record(rows, spec, 30 if spec == faster else 10, 0.01)
    rates = gate.rates()
    assert rates[4]["speculate"] > rates[4]["plain"] and rates[128]["plain"] > rates[128]["speculate"]


def test_the_first_step_after_a_switch_is_not_measured():
    gate = SpecGate()
    gate.record(8, True, 100, 0.01)
    gate.record(8, False, 0, 0.01)  # the plain loop's first step reads nothing yet
    assert gate.rates()[8]["plain"] is None
    gate.record(8, False, 50, 0.01)
    assert gate.rates()[8]["plain"] == pytest.approx(5000)


class _Alternate:
    """A gate that switches mode every `period` steps: the hardest case for the loop's transitions."""

    def __init__(self, period: int) -> None:
        self.period, self.n, self.steps = period, 0, {"plain": 0, "speculate": 0}

    def choose(self, rows: int) -> bool:
        self.n += 1
        spec = (self.n // self.period) % 2 == 0
        self.steps["speculate" if spec else "plain"] += 1
        return spec

    def record(self, *args) -> None:
        pass

    def passed(self) -> None:
        pass


@pytest.mark.parametrize("period", [1, 3])
def test_switching_modes_keeps_tokens_identical(tiny_model, period):
    """Steps with drafts (serial) and plain overlapped steps, alternating: greedy, seeded sampling,
    stop strings and chunked prefill give the plain engine's tokens, and the allocator stays sound."""
    rng = random.Random(5)
    reqs = [Request(f"r{i}", rand_prompt(rng, 4 + 11 * i), SamplingParams(max_tokens=20, temperature=t, seed=i, ignore_eos=True))
            for i, t in enumerate([0.0, 0.8, 0.0, 1.1, 0.0])]
    reqs.append(Request("mt", rand_prompt(rng, 9), SamplingParams(max_tokens=16, temperature=0.7, seed=9, min_tokens=12)))
    kw = {"max_num_batched_tokens": 24, "max_num_seqs": 4}
    plain = run(make_engine(tiny_model, **kw), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []
    engine = make_engine(tiny_model, {"num_tokens": 4, "gate": True}, on_step=steps.append, drafter=oracle(truth, 0.3, 500), **kw)
    engine.speculator.gate = gate = _Alternate(period)
    assert_same(plain, run(engine, reqs))
    assert gate.steps["plain"] > 3 and gate.steps["speculate"] > 3
    assert sum(s.spec_accepted for s in steps) > 0


def test_switching_modes_under_a_json_schema(tiny_model):
    """The same with grammar-forced drafts and the plain loop's started mask fills in between."""
    names = ["enum_const", "bounded_numbers", "optional_fields", "flat_object"]
    constraints = [Constraint.json_schema(json.loads((EXAMPLES / f"{n}.json").read_text())) for n in names]
    reqs = [Request(f"g{i}", [5 + i, 40, 77], SamplingParams(max_tokens=60, temperature=[1.0, 0.0][i % 2], seed=i), constraints[i])
            for i in range(4)]
    plain = run(make_engine(tiny_model, grammar_backend="llguidance"), reqs)
    engine = make_engine(tiny_model, {"method": "ngram+grammar", "num_tokens": 5, "gate": True}, grammar_backend="llguidance")
    engine.speculator.gate = _Alternate(2)
    spec = run(engine, reqs)
    assert_same(plain, spec)
    for r in reqs:
        if spec[r.request_id].finish_reason == "stop":
            assert validate_output(r.constraint, spec[r.request_id].text)[1] is None


def test_the_real_gate_runs_both_modes_and_reports_rates(tiny_model):
    """With the measured gate the output is still the plain engine's; both modes were tried in the
    bucket the run spent its steps in."""
    rng = random.Random(8)
    reqs = [Request(f"r{i}", rand_prompt(rng, 6 + i), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            for i in range(6)]
    plain = run(make_engine(tiny_model), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    engine = make_engine(tiny_model, {"num_tokens": 4, "gate": True}, drafter=oracle(truth, 0.0, 500))
    engine.speculator.gate = gate = SpecGate(GateConfig(probe_interval=4, probe_steps=2))
    assert_same(plain, run(engine, reqs))
    assert gate.steps["plain"] > 0 and gate.steps["speculate"] > 0
    measured = gate.rates()[4]
    assert measured["plain"] is not None and measured["speculate"] is not None
