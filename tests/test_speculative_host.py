"""The host side of speculative verify steps (engine/verify.py, finish.append_tokens, the runner's
verify-width sample rows): each vectorised or batched piece against the one-token-at-a-time rule it
replaces, and the engine token-identical to plain decoding where a draft crosses a stop: EOS or a
stop token inside accepted drafts, max_tokens or max_model_len reached mid-draft, stop strings,
min_tokens, grammars, logprobs rows, all mixed in one batch."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_speculative import assert_same, make_engine, oracle, rand_prompt, run

from batchinfer.engine import Request, SamplingParams
from batchinfer.engine.finish import append_token, append_tokens
from batchinfer.engine.model_runner import sample_rows
from batchinfer.engine.sequence import Sequence
from batchinfer.engine.speculative import SpecCounts
from batchinfer.engine.verify import row_bans, row_steps, settle_drafts
from batchinfer.structured.base import Constraint

EOS = frozenset({7, 9})


# --- pieces against their one-at-a-time rule ------------------------------------------------------


@given(st.lists(st.tuples(st.integers(1, 6), st.booleans(), st.integers(1, 5)), min_size=0, max_size=12))
@settings(max_examples=200, deadline=None)
def test_sample_rows_are_each_chunks_last_width_rows(chunks):
    lens = [n for n, _, _ in chunks]
    samples = [s for _, s, _ in chunks]
    widths = [min(w, n) for n, s, w in chunks if s]
    ends = np.cumsum(np.asarray(lens, dtype=np.int64))
    want, k = [], 0
    for end, s in zip(ends.tolist(), samples):
        if s:
            want += list(range(end - widths[k], end))
            k += 1
    assert sample_rows(ends, samples, widths).tolist() == want
    assert sample_rows(ends, samples).tolist() == [e - 1 for e, s in zip(ends.tolist(), samples) if s]


def make_seq(prompt_len: int, generated: list[int], sampling: SamplingParams, draft: list[int] = ()) -> Sequence:
    seq = Sequence.from_request(0, Request("r", list(range(10, 10 + prompt_len)), sampling))
    seq.token_ids += generated + list(draft)
    seq.num_draft = len(draft)
    seq.num_computed_tokens = seq.num_tokens - 1 - len(draft)
    return seq


def test_row_steps_and_bans_per_position():
    p = SamplingParams(max_tokens=20, min_tokens=4, stop_token_ids=(3,))
    seqs = [make_seq(5, [1, 2], p, draft=[4, 4, 4]), make_seq(3, [1] * 6, p, draft=[5]), make_seq(2, [], p)]
    widths = np.array([4, 2, 1])
    first = np.array([2, 6, 0])
    assert row_steps(first, widths).tolist() == [2, 3, 4, 5, 6, 7, 0]

    def bans_at(seq, g):
        return [3, 7] if g < 4 else []

    assert row_bans(seqs, widths, first, bans_at) == [[3, 7], [3, 7], [], [], [], [], [3, 7]]
    assert row_bans(seqs[1:2], widths[1:2], first[1:2], bans_at) is None  # past min_tokens: nothing to ban


token = st.integers(0, 12)


@given(st.integers(1, 6), st.lists(token, max_size=6), st.lists(token, min_size=1, max_size=6),
       st.integers(1, 14), st.lists(token, max_size=2), st.booleans(), st.integers(0, 30))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_append_tokens_is_append_token_in_turn(tokenizer, prompt_len, generated, tokens, max_tokens, stop_ids,
                                               ignore_eos, max_len_extra):
    max_tokens = max(max_tokens, len(generated) + 1)
    p = SamplingParams(max_tokens=max_tokens, stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
    max_model_len = prompt_len + len(generated) + 1 + max_len_extra
    a, b = make_seq(prompt_len, generated, p), make_seq(prompt_len, generated, p)
    want_n, want_done = 0, False
    for t in tokens:
        want_n += 1
        if append_token(a, t, 1.5, None, EOS, max_model_len, tokenizer):
            want_done = True
            break
    assert append_tokens(b, tokens, 1.5, EOS, max_model_len, tokenizer) == (want_n, want_done)
    for field in ("token_ids", "finish_reason", "error", "text", "first_token", "finished"):
        assert getattr(b, field) == getattr(a, field), field


def test_append_tokens_refuses_a_sequence_with_stop_strings(tokenizer):
    seq = make_seq(3, [], SamplingParams(max_tokens=5, stop=("x",)))
    seq.detokenizer = object()
    with pytest.raises(ValueError, match="append_token"):
        append_tokens(seq, [1], 0.0, EOS, 100, tokenizer)


@given(st.lists(st.tuples(st.lists(token, max_size=4), st.lists(token, min_size=5, max_size=5)), min_size=1, max_size=8))
@settings(max_examples=200, deadline=None)
def test_settle_drafts_keeps_the_longest_matching_prefix(rows):
    p = SamplingParams(max_tokens=50)
    seqs = [make_seq(4, [1, 2], p, draft=d) for d, _ in rows]
    widths = [1 + len(d) for d, _ in rows]
    tokens = [t for (d, out) in rows for t in out[: 1 + len(d)]]
    counts = SpecCounts()
    emitted, decoding = settle_drafts(seqs, widths, tokens, counts, {})
    accepted = 0
    for seq, (d, out), got in zip(seqs, rows, emitted):
        a = 0
        while a < len(d) and d[a] == out[a]:
            a += 1
        accepted += a
        assert got == out[: a + 1]
        assert seq.num_draft == 0 and seq.token_ids[-2:] == [1, 2]  # drafts removed, nothing appended
    assert decoding == [True] * len(rows)
    assert (counts.rows, counts.verified, counts.accepted) == (sum(1 for d, _ in rows if d), sum(map(len, (d for d, _ in rows))), accepted)


# --- the engine: token-identical where drafts cross a stop --------------------------------------------


def frequent_tokens(outputs, n: int) -> frozenset[int]:
    """The n most common output tokens of a plain run (to act as EOS: they then end many answers mid-draft)."""
    counts: dict[int, int] = {}
    for out in outputs:
        for t in set(out[1:]):
            counts[t] = counts.get(t, 0) + 1
    return frozenset(sorted(counts, key=counts.get, reverse=True)[:n])


def with_eos(engine, eos: frozenset[int]):
    engine.eos_token_ids = eos
    return engine


def test_eos_inside_accepted_drafts(tiny_model):
    """An EOS the oracle drafts is accepted like any token; the answer ends there, mid-draft, as in plain decoding."""
    rng = random.Random(11)
    base = [Request(f"e{i}", rand_prompt(rng, 3 + 5 * i), SamplingParams(max_tokens=24, temperature=[0.0, 0.9][i % 2], seed=i, ignore_eos=True))
            for i in range(10)]
    free = run(make_engine(tiny_model), base)
    eos = frequent_tokens((r.output_token_ids for r in free.values()), 2)
    reqs = [replace(r, sampling=replace(r.sampling, ignore_eos=False)) for r in base]
    reqs += [replace(r, request_id=f"min-{r.request_id}", sampling=replace(r.sampling, ignore_eos=False, min_tokens=6)) for r in base[:3]]
    plain = run(with_eos(make_engine(tiny_model), eos), reqs)
    ended = sum(r.output_token_ids[-1] in eos and r.finish_reason == "stop" for r in plain.values())
    assert ended >= 5, f"only {ended} answers ended at the stand-in EOS"
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []
    spec = run(with_eos(make_engine(tiny_model, {"num_tokens": 4}, on_step=steps.append, drafter=oracle(truth, 0.0, 500)), eos), reqs)
    assert_same(plain, spec)
    # every draft right: answers that end at EOS ended inside a verified draft
    assert sum(s.spec_accepted for s in steps) == sum(s.spec_verified for s in steps) > 0


def test_max_tokens_and_max_model_len_mid_draft(tiny_model):
    """Drafts never run past max_tokens or max_model_len; the last token lands exactly as without them."""
    rng = random.Random(12)
    reqs = [Request(f"m{i}", rand_prompt(rng, n), SamplingParams(max_tokens=k, temperature=t, seed=i, ignore_eos=True))
            for i, (n, k, t) in enumerate([(5, 1, 0.0), (6, 2, 0.8), (9, 7, 0.0), (20, 28, 1.0), (12, 36, 0.0)])]
    plain, spec, _ = _plain_and_spec(tiny_model, reqs, 0.1, max_model_len=48)
    assert_same(plain, spec)
    assert {r.finish_reason for r in spec.values()} == {"length"}
    assert [len(spec[r.request_id].output_token_ids) for r in reqs] == [1, 2, 7, 28, 36]


@given(st.integers(0, 10_000), st.floats(0.0, 0.5))
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_mixed_stops_in_one_batch_same_tokens(tiny_model, seed, corrupt):
    """Plain rows (the fast append) next to stop-token, stop-string, min_tokens, logprobs and grammar
    rows (appended column by column), in one batch: every answer as without speculation."""
    rng = random.Random(seed)
    base = [Request(f"b{i}", rand_prompt(rng, rng.randrange(1, 25)),
                    SamplingParams(max_tokens=rng.randrange(2, 16), temperature=rng.choice([0.0, 0.7, 1.0]), seed=i, ignore_eos=True))
            for i in range(4)]
    free = run(make_engine(tiny_model), base)
    reqs = list(base)
    for i, r in enumerate(base):
        out, text = free[r.request_id].output_token_ids, free[r.request_id].text
        kind = rng.choice(["stop_id", "min", "stop_str", "logprobs", "grammar"])
        s = r.sampling
        if kind == "stop_id":
            s = replace(s, stop_token_ids=(out[rng.randrange(len(out))],))
        elif kind == "min":
            s = replace(s, stop_token_ids=(out[0],), min_tokens=rng.randrange(0, s.max_tokens + 1))
        elif kind == "stop_str" and len(text) > 3:
            j = rng.randrange(len(text) - 2)
            s = replace(s, stop=(text[j : j + 2],))
        elif kind == "logprobs":
            s = replace(s, logprobs=1)
        constraint = Constraint.regex(r"[a-z]{1,6}( [a-z]{1,6}){0,3}") if kind == "grammar" else None
        if kind == "grammar":
            s = replace(s, ignore_eos=False)
        reqs.append(Request(f"{kind}{i}", r.prompt_token_ids, s, constraint))
    plain, spec, _ = _plain_and_spec(tiny_model, reqs, corrupt)
    assert_same(plain, spec)


def _plain_and_spec(path, reqs, corrupt, **kw):
    plain = run(make_engine(path, **kw), reqs)
    truth = {rid: r.output_token_ids for rid, r in plain.items()}
    steps: list = []
    spec = run(make_engine(path, {"method": "ngram+grammar", "num_tokens": 4}, on_step=steps.append,
                           drafter=oracle(truth, corrupt, 500), **kw), reqs)
    return plain, spec, steps
