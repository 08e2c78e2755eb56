"""The batched grammar host paths give exactly what the per-row paths give.

GrammarCompiler.accept_tokens (one call per library) against accept_token row by row,
start_fill in the background against fill_next_token_bitmask row by row, the vectorised EOS
mirroring against a per-row reference, and the engine's early mask fill (overlap) against the
serial loop, token for token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.structured.base import Constraint
from batchinfer.structured.bitmask import allocate_token_bitmask, unpack_bitmask
from batchinfer.structured.compiler import GrammarCompiler
from batchinfer.structured.llguidance_backend import mirror_eos_rows

EXAMPLES = Path(__file__).resolve().parent.parent / "schemas" / "examples"
VOCAB = 520
SCHEMAS = ["enum_const", "bounded_numbers", "top_level_array", "optional_fields"]


@pytest.fixture(scope="module")
def compilers(tokenizer):
    shared: dict = {}
    eos = [tokenizer.eos_token_id, 3]  # two EOS ids, so llguidance rows need mirroring
    return {n: GrammarCompiler(tokenizer, VOCAB, n, eos_ids=eos, shared_backends=shared)
            for n in ("llguidance", "xgrammar", "outlines")}


def constraints() -> list[Constraint]:
    cs = [Constraint.json_schema(json.loads((EXAMPLES / f"{n}.json").read_text())) for n in SCHEMAS]
    return cs + [Constraint.regex(r"[A-Z]{2}-[0-9]{3}"), Constraint.choice(["yes", "no", "maybe"])]


def mixed_matchers(compilers, copies: int) -> list:
    """Two matchers per (backend, constraint) pair, `copies` times over, interleaved."""
    out = []
    for _ in range(copies):
        for name in ("llguidance", "xgrammar", "outlines"):
            for c in constraints():
                out.append(compilers[name].compile(c).new_matcher())
    return out


@pytest.mark.parametrize("background", [False, True])
def test_batched_accept_and_fill_match_row_by_row(compilers, background):
    """Random walks: every step, the batched accept and the (background) batched fill equal the
    single-matcher calls on twin matchers."""
    comp = compilers["llguidance"]  # any compiler batches every library's matchers
    rng = np.random.default_rng(0)
    batched = mixed_matchers(compilers, 1)
    single = mixed_matchers(compilers, 1)
    n = len(batched)
    alive = list(range(n))
    for _ in range(25):
        if not alive:
            break
        rows = [int(r) for r in rng.permutation(len(alive))]  # rows in a shuffled order
        many = allocate_token_bitmask(len(alive), VOCAB)
        comp.start_fill([batched[i] for i in alive], many, rows, background=background).wait()
        one = allocate_token_bitmask(len(alive), VOCAB)
        for i, r in zip(alive, rows):
            single[i].fill_next_token_bitmask(one, r)
        assert torch.equal(many, one)
        allowed = unpack_bitmask(one, VOCAB)
        tokens = []
        for r in rows:
            ids = allowed[r].nonzero().flatten().numpy()
            # mostly allowed tokens; now and then a random one, which some grammars reject
            tokens.append(int(rng.choice(ids)) if ids.size and rng.random() < 0.9 else int(rng.integers(VOCAB)))
        got = comp.accept_tokens([batched[i] for i in alive], tokens)
        want = [single[i].accept_token(t) for i, t in zip(alive, tokens)]
        assert got == want
        for i, ok in zip(alive, got):
            assert batched[i].is_terminated() == single[i].is_terminated()
        alive = [i for i, ok in zip(alive, got) if ok and not single[i].is_terminated()]


def test_mirror_eos_rows_matches_per_row_reference():
    rng = np.random.default_rng(1)
    words = 40
    mask = torch.from_numpy(rng.integers(-(2**31), 2**31, size=(9, words), dtype=np.int64).astype(np.int32))
    eos = (37, 31, 1000 % (words * 32), 63)  # bit 31 included: the int32 sign bit
    rows = [0, 2, 3, 5, 8]
    want = mask.clone()
    for r in rows:
        bits = unpack_bitmask(want[r : r + 1], words * 32)[0]
        if bits[eos[0]]:
            for e in eos[1:]:
                w, b = divmod(e, 32)
                v = int(want[r, w]) & 0xFFFFFFFF | (1 << b)
                want[r, w] = v - (1 << 32) if v >= (1 << 31) else v
    got = mask.clone()
    mirror_eos_rows(got, rows, eos)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 4, 6, 7]], mask[[1, 4, 6, 7]])  # other rows untouched


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
def test_engine_overlap_with_early_fill_equals_serial(tiny_model, backend):
    """The early (background) mask fill of the overlap loop gives the serial loop's tokens."""
    cs = constraints()
    reqs = [Request(f"r{i}", [5 + i, 40, 77], SamplingParams(max_tokens=60, temperature=1.0, seed=i), cs[i % len(cs)])
            for i in range(12)]
    outs = {}
    for overlap in (False, True):
        engine = Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=256,
                                     block_size=8, grammar_backend=backend, overlap=overlap, max_num_seqs=6))
        outs[overlap] = {r.request_id: (r.finish_reason, r.output_token_ids) for r in engine.generate(reqs)}
    assert outs[True] == outs[False]
    assert any(reason == "stop" for reason, _ in outs[True].values())
