"""When speculation pays: the per-sequence draft length follows measured acceptance (off when drafts
are never right, probed and back on when they are), no drafts in a compute-bound step, and the
draft sources' helpers (space-insensitive n-gram keys, the grammar's forced text). Outputs stay
token-identical to plain decoding throughout."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.engine.drafts import DraftLength, ForcedText, match_keys, ngram_draft

VOCAB = 500  # the tiny test model's ids used by the prompts


# --- DraftLength ----------------------------------------------------------------------------


def test_draft_length_switches_off_probes_and_comes_back():
    d = DraftLength()
    assert d.length(8, 0.1, 4) == 8  # no evidence yet: as many as allowed
    shrinking = []
    while (k := d.length(8, 0.1, 4)) > 0:
        shrinking.append(k)
        d.update(k, 0)  # every draft rejected at its first token
        assert len(shrinking) < 10, "drafting never stopped for a sequence whose drafts are always wrong"
    assert shrinking == sorted(shrinking, reverse=True) and shrinking[0] == 8
    # off: one probe token every 4th step, nothing in between (the loop's last call was the first 0)
    lengths = [d.length(8, 0.1, 4) for _ in range(11)]
    assert lengths == [0, 0, 1] + [0, 0, 0, 1] * 2
    # probes accepted: drafting comes back, up to the most allowed
    for _ in range(10):
        k = d.length(8, 0.1, 4)
        while k == 0:
            k = d.length(8, 0.1, 4)
        d.update(k, k)
    assert d.length(8, 0.1, 4) == 8


def test_draft_length_follows_acceptance():
    """Half-right drafts (first token right, second wrong) settle at a short length."""
    d = DraftLength()
    for _ in range(20):
        k = d.length(8, 0.1, 4)
        d.update(k, min(k, 1) if k > 1 else k)
    assert 1 <= d.length(8, 0.1, 4) <= 3
    assert d.length(8, 0.9, 4) in (0, 1)  # a high threshold: off (or a probe)


# --- the draft sources' helpers ---------------------------------------------------------------


class Vocab:
    def __init__(self, pieces):
        self.pieces = pieces

    def get_vocab(self):
        return {p: i for i, p in enumerate(self.pieces)}


def test_match_keys_ignore_a_leading_space():
    keys = match_keys(Vocab(["NS", "ĠNS", "▁-", "-", "Ġ", "Ġonly"]), 8)
    assert keys.tolist() == [0, 0, 3, 3, 4, 5, 6, 7]  # "Ġ" alone and "Ġonly" (no "only") keep their ids


def test_ngram_draft_with_keys_copies_the_document_span():
    # prompt "... ĠNS - 2 0 2 4 \n" ; answer so far: '"' 'NS' '-'
    tokens = np.array([9, 1, 3, 10, 11, 10, 12, 13, 7, 0, 3], dtype=np.int64)
    keys = np.array([9, 0, 3, 10, 11, 10, 12, 13, 7, 0, 3], dtype=np.int64)  # ĠNS (1) keyed as NS (0)
    assert ngram_draft(tokens, (3, 2, 1), 4).tolist() == [10, 11, 10, 12]  # 1-gram '-': lucky here
    assert ngram_draft(tokens, (3, 2), 4).tolist() == []  # exact tokens: 'NS -' never occurred
    assert ngram_draft(tokens, (3, 2), 4, keys).tolist() == [10, 11, 10, 12]  # by key it did


class FakeTokenizer:
    """Characters as tokens (id = code point), enough for ForcedText."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, clean_up_tokenization_spaces=False):
        return "".join(chr(i) for i in ids)


class Forced:
    def __init__(self, text):
        self.text = text

    def forced_text(self):
        return self.text


def test_forced_text_tokens_after_the_forced_ones():
    ft = ForcedText(FakeTokenizer())
    assert ft.extend(Forced('":"'), [], 5) == [ord('"'), ord(":"), ord('"')]
    assert ft.extend(Forced('date":"'), [ord("d"), ord("a")], 3) == [ord("t"), ord("e"), ord('"')]
    assert ft.extend(Forced("ab"), [ord("a"), ord("b")], 3) == []  # nothing beyond the forced tokens
    assert ft.extend(Forced("xy"), [ord("a")], 3) == []  # forced tokens that are not the text's start
    assert ft.extend(Forced(""), [], 3) == []


# --- the engine ---------------------------------------------------------------------------------


def make_engine(path, speculative=None, on_step=None, drafter=None, **kw) -> Engine:
    cfg = EngineConfig(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256, block_size=8,
                       speculative=speculative, **kw)
    return Engine(cfg, on_step=on_step, drafter=drafter)


def requests(n=3, max_tokens=40):
    rng = random.Random(7)
    return [Request(f"r{i}", [rng.randrange(3, VOCAB) for _ in range(5 + 7 * i)],
                    SamplingParams(max_tokens=max_tokens, temperature=[0.0, 0.9][i % 2], seed=i, ignore_eos=True))
            for i in range(n)]


def outputs(engine, reqs):
    got = {r.request_id: r.output_token_ids for r in engine.generate(reqs)}
    assert engine.allocator.num_used == 0
    return got


@pytest.fixture(scope="module")
def truth(tiny_model):
    return outputs(make_engine(tiny_model), requests())


def wrong_then_right(truth, right_from: int):
    """Drafts of the true output, each token made wrong while the sequence has fewer than
    `right_from` output tokens."""

    def draft(seq, k):
        g = seq.num_generated
        out = truth.get(seq.request.request_id, [])[g : g + k]
        return [(t + 1) % VOCAB if g + j < right_from else t for j, t in enumerate(out)]

    return draft


def test_always_wrong_drafts_stop_and_tokens_stay_the_same(tiny_model, truth):
    steps: list = []
    spec = {"method": "ngram", "num_tokens": 4, "probe_interval": 8}
    engine = make_engine(tiny_model, spec, steps.append, drafter=wrong_then_right(truth, 10**9))
    assert outputs(engine, requests()) == truth
    assert sum(s.spec_accepted for s in steps) == 0
    # without the policy: 4 drafts per sequence and step (~40 steps x 3 sequences = ~480)
    verified = sum(s.spec_verified for s in steps)
    decode_rows = sum(s.spec_decode_rows for s in steps)
    assert decode_rows > 100
    # a few steps of shrinking drafts per sequence, then one probe token every 8th step
    assert verified <= 3 * (4 + 3 + 2 + 2 + 1 + 1) + decode_rows // 8 + 3, verified


def test_drafting_comes_back_when_drafts_turn_right(tiny_model, truth):
    steps: list = []
    engine = make_engine(tiny_model, {"method": "ngram", "num_tokens": 4, "probe_interval": 4}, steps.append,
                         drafter=wrong_then_right(truth, 14))
    assert outputs(engine, requests()) == truth
    late = [s for s in steps if s.spec_accepted]
    assert sum(s.spec_accepted for s in steps) >= 3 * 10, "drafting did not resume after the wrong stretch"
    assert max(s.spec_accepted for s in late) >= 6  # several sequences back at long drafts


@pytest.mark.parametrize("prefill_first", [True, False], ids=["prefill-first", "drafts-first"])
def test_max_step_tokens_bounds_the_tokens_before_drafts(tiny_model, truth, prefill_first):
    """max_step_tokens: with prefill_first, a step already computing that many tokens (prefill
    included) verifies no drafts; drafts first (the default), a step's decodes and drafts stay within
    it and the prompt's prefill takes the rest of the budget, so steps that prefill a long prompt
    verify drafts too."""
    steps: list = []
    reqs = requests() + [Request("long", list(range(3, 3 + 120)), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))]
    plain = outputs(make_engine(tiny_model, max_num_batched_tokens=64), reqs)
    engine = make_engine(tiny_model, {"method": "ngram", "num_tokens": 4, "max_step_tokens": 32,
                                      "prefill_first": prefill_first}, steps.append,
                         drafter=wrong_then_right(truth, 0), max_num_batched_tokens=64)
    assert outputs(engine, reqs) == plain
    busy = [s for s in steps if s.num_prefill_tokens + s.spec_decode_rows >= 32]
    assert busy, "no step was compute-bound"
    if prefill_first:
        assert all(s.spec_verified == 0 for s in busy)
    else:
        assert any(s.num_prefill_tokens and s.spec_verified for s in busy), "no step prefilled and verified"
        assert all(s.num_decode_tokens + s.spec_verified <= 32 for s in steps), "decodes and drafts past max_step_tokens"
    assert sum(s.spec_accepted for s in steps) > 0  # the other steps drafted (right drafts)


def test_run_records_and_report_count_each_source():
    import polars as pl

    from batchinfer.engine.stats import StepStats
    from batchinfer.observe.records import STEP_SCHEMA, step_record
    from batchinfer.observe.report import _speculative

    def stats(i, **spec):
        return StepStats(step=i, time=float(i), num_running=2, num_waiting=0, num_prefill_tokens=0, num_decode_tokens=6,
                         kv_blocks_used=1, kv_blocks_free=9, num_preemptions=0, schedule_ms=0.1, step_ms=1.0, **spec)

    steps = [stats(1, spec_drafted=6, spec_verified=5, spec_accepted=4, spec_rows=2, spec_decode_rows=2, spec_emitted=6,
                   spec_forced_drafted=2, spec_forced_verified=2, spec_forced_accepted=2, spec_text_drafted=1,
                   spec_text_verified=1, spec_text_accepted=0),
             stats(2, spec_drafted=3, spec_verified=3, spec_accepted=3, spec_rows=1, spec_decode_rows=2, spec_emitted=5,
                   spec_text_drafted=1, spec_text_verified=1, spec_text_accepted=1)]
    frame = pl.from_arrow(pa_table([step_record("run", s, 0.0) for s in steps], STEP_SCHEMA))
    sp = _speculative(frame)
    assert sp["accepted"] == 7 and sp["tokens_per_seq_per_forward"] == 11 / 4
    assert sp["accepted_by_source"] == {"grammar_forced": 2, "grammar_text": 1, "ngram": 4}
    # records written before the source columns existed: totals without the split
    assert "accepted_by_source" not in _speculative(frame.drop([c for c in frame.columns if "_forced_" in c or "_text_" in c]))


def pa_table(records, schema):
    import pyarrow as pa

    return pa.Table.from_pylist(records, schema=schema)
