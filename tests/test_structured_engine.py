"""Constrained generation end to end through Engine.generate on a tiny random model (CPU).

At temperature 1.0 a random model samples wildly; the grammar must still make every successful
answer parse and validate against the full schema.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.structured.base import Constraint
from batchinfer.structured.validate import validate_output

EXAMPLES = Path(__file__).resolve().parent.parent / "schemas" / "examples"


@pytest.mark.parametrize("backend", ["auto", "xgrammar"])
def test_every_constrained_success_validates(tiny_model, backend):
    engine = Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=256,
                                 block_size=8, grammar_backend=backend))
    names = ["enum_const", "bounded_numbers", "top_level_array", "optional_fields"]
    constraints = [Constraint.json_schema(json.loads((EXAMPLES / f"{n}.json").read_text())) for n in names]
    constraints += [Constraint.regex(r"[A-Z]{2}-[0-9]{3}"), Constraint.choice(["yes", "no", "maybe"])]
    requests = [
        Request(f"r{i}", [5 + i, 40, 77], SamplingParams(max_tokens=120, temperature=1.0, seed=i), constraints[i % len(constraints)])
        for i in range(8)
    ]
    by_id = {r.request_id: r for r in requests}
    results = list(engine.generate(requests))
    assert sorted(r.request_id for r in results) == sorted(by_id)
    successes = 0
    for res in results:
        assert res.finish_reason in ("stop", "length"), res.error
        if res.finish_reason == "stop":
            value, err = validate_output(by_id[res.request_id].constraint, res.text)
            assert err is None, f"{res.request_id}: {res.text!r}: {err}"
            successes += 1
    assert successes >= 6
