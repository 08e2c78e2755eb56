"""One mask per grammar state (GrammarState share_masks): the same masks and the same tokens as one
fill per row.

The engine's outputs equal those of the per-row fill token for token (greedy rows take equal token
histories, so many rows get a copy; sampled rows, stop strings and a second constraint mixed in), on
the demo vocabulary and on the real Qwen vocabulary (151,936 rows, a one-layer random body, as
scripts/grammar_host_bench.py; slow). And at the GrammarState level, each step's masks against
twin matchers filled one row at a time.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.bench.workloads import DOCS_SCHEMA
from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.engine.grammar import GrammarState
from batchinfer.engine.sequence import Sequence, SequenceStatus
from batchinfer.structured.base import Constraint
from batchinfer.structured.bitmask import unpack_bitmask
from batchinfer.structured.state_keys import plain_leads, vocab_plain_leads

TINY_BODY = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32)


@pytest.fixture(scope="module")
def qwen_vocab_model(tmp_path_factory) -> Path:
    """The qwen3-0.6b shape folder (real Qwen tokenizer) with a one-layer body, random weights."""
    from batchinfer.bench.shapes import write_shape

    out = write_shape("qwen3-0.6b", tmp_path_factory.mktemp("shapes") / "tiny-qwen")
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(TINY_BODY)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _requests() -> list[Request]:
    docs = Constraint.json_schema(DOCS_SCHEMA)
    code = Constraint.regex(r"[A-Z]{2}-[0-9]{3}( [a-z]{1,6}){0,4}")
    reqs = []
    for i in range(20):
        greedy = i % 4 != 3
        sampling = SamplingParams(max_tokens=40, temperature=0.0 if greedy else 1.0, seed=i,
                                  stop=['"language"'] if i % 5 == 1 else None)
        reqs.append(Request(f"r{i}", [11 + i, 300, 4000 + 7 * i], sampling, code if i % 6 == 5 else docs))
    return reqs


def _run_both(model: Path, backend: str, reqs: list[Request], **kw) -> tuple[dict, dict]:
    """Outputs and GrammarStates of the engine with shared masks (True) and per-row fills (False)."""
    outs, states = {}, {}
    for share in (False, True):
        engine = Engine(EngineConfig(model=str(model), dtype="float32", device="cpu", grammar_backend=backend,
                                     grammar_share_masks=share, **kw))
        outs[share] = {r.request_id: (r.finish_reason, r.output_token_ids) for r in engine.generate(reqs)}
        states[share] = engine.grammar
    return outs, states


def _check(outs: dict, states: dict) -> None:
    assert outs[True] == outs[False]
    on, off = states[True], states[False]
    assert off.rows_copied == off.rows_cached == 0
    assert on.rows_copied + on.rows_cached > 0  # the run exercised shared masks
    assert on.rows_computed + on.rows_copied + on.rows_cached == off.rows_computed


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_shared_masks_give_the_per_row_outputs(tiny_model, backend):
    """Greedy and sampled rows, two constraints, stop strings: the same tokens either way."""
    cs = [Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                                                   "b": {"type": "integer"}}, "required": ["a", "b"]}),
          Constraint.regex(r"[A-Z]{2}-[0-9]{3}( [a-z]{1,6}){0,4}")]
    reqs = [Request(f"r{i}", [5 + i, 40, 77], SamplingParams(max_tokens=40, temperature=0.0 if i % 3 else 1.0, seed=i,
                                                             stop=["b"] if i % 5 == 1 else None), cs[i % 2])
            for i in range(16)]
    outs, states = _run_both(tiny_model, backend, reqs, num_kv_blocks=256, block_size=8, max_num_seqs=8)
    _check(outs, states)
    assert any(reason == "stop" for reason, _ in outs[True].values())


@pytest.mark.slow
def test_shared_masks_give_the_per_row_outputs_on_the_qwen_vocabulary(qwen_vocab_model):
    """The benchmark's schema on the real 151,936-row vocabulary (llguidance, the default)."""
    docs = Constraint.json_schema(DOCS_SCHEMA)
    reqs = [Request(f"r{i}", [11 + i, 300, 4000 + 7 * i], SamplingParams(max_tokens=24, temperature=0.0), docs)
            for i in range(6)]
    outs, states = _run_both(qwen_vocab_model, "llguidance", reqs, load_format="random", num_kv_blocks=64,
                             block_size=16, max_num_seqs=6)
    _check(outs, states)


def _seqs(state: GrammarState, constraints: list[Constraint], n: int) -> list[Sequence]:
    seqs = []
    for i in range(n):
        seq = Sequence.from_request(i, Request(f"s{i}", [1], SamplingParams(max_tokens=50), constraints[i // 2 % len(constraints)]))
        assert state.attach(seq, seq.request.constraint) is None
        seq.status = SequenceStatus.RUNNING
        seqs.append(seq)
    return seqs


def test_shared_masks_equal_per_row_masks_on_random_walks(tokenizer):
    """Twin sets of sequences, one state sharing masks and one not: rows in pairs (same constraint)
    mostly take the same token (so their keys stay equal) until a pair splits; each step's masks are equal, the started
    fill and the rows it missed alike, and rows reset after their fill (not live) stay all-allowed."""
    vocab = 520
    constraints = [Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 12},
                                                                            "b": {"type": "integer"}},
                                           "required": ["a", "b"]}),
                   Constraint.regex(r"[a-c]{1,5}-[0-9]{2,3}")]
    eos = [tokenizer.eos_token_id]
    states = [GrammarState(tokenizer, vocab, "llguidance", eos, 1, 16, False, share_masks=s) for s in (True, False)]
    twins = [_seqs(s, constraints, 16) for s in states]
    rng = np.random.default_rng(3)
    fresh = set(range(0, 16, 3))  # rows left out of start_fill on odd steps: bitmask() fills (and shares) them
    for step in range(30):
        live = [s.status is SequenceStatus.RUNNING for s in twins[0]]
        if not any(live):
            break
        stale = [bool(rng.random() < 0.1) for _ in live]  # finished after their fill started
        masks = []
        for state, seqs in zip(states, twins):
            skip = [(s, 0) for i, s in enumerate(seqs) if i in fresh and step % 2]
            fill = state.start_fill(seqs, skip, ["terminated"] * len(skip))
            mask = state.bitmask(seqs, [ok and not bad for ok, bad in zip(live, stale)], fill)
            masks.append(mask.dense())
        assert torch.equal(masks[0], masks[1])
        for r, bad in enumerate(stale):
            if bad and live[r]:
                assert bool((masks[0][r] == -1).all())
        allowed = unpack_bitmask(masks[1], vocab)
        tokens = []
        for r in range(16):
            ids = allowed[r].nonzero().flatten().numpy()
            if r % 2 and rng.random() < 0.8 and tokens:
                tokens.append(tokens[-1])  # the pair's twin takes its token: same key
            else:
                tokens.append(int(rng.choice(ids)) if ids.size else 0)
        for state, seqs in zip(states, twins):
            rows = [(s, t) for s, t, ok in zip(seqs, tokens, live) if ok]
            verdicts = state.accept(rows)
            for (s, _), v in zip(rows, verdicts):
                if v in ("rejected", "terminated"):
                    s.status = SequenceStatus.FINISHED
        assert [s.status for s in twins[0]] == [s.status for s in twins[1]]
    assert states[0].rows_copied + states[0].rows_cached > 0
    for state in states:
        state.close()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=8) | st.sampled_from([b"", b'"', b"\\", b"\xe4\xb8\xad", b"\x80\x80", b"a\x1fb"]), max_size=40))
def test_vocab_plain_leads_is_plain_leads_of_each_token(tokens):
    """The whole-vocabulary table (numpy, built once per engine) gives what plain_leads gives per token."""
    assert vocab_plain_leads(tokens) == [plain_leads(b) for b in tokens]
