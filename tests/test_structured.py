"""Structured output: vocabulary adapter, backends, auto fallback, bitmask, validation, Arrow types.

Random walks drive every grammar: at each step pick a uniformly random token among those the
filled bitmask allows (a temperature-infinity sampler, harsher than any model), until the matcher
terminates or a token cap. Every terminated answer must parse and validate.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.structured.arrow import arrow_type_for_schema, to_arrow_value
from batchinfer.structured.base import Constraint, GrammarError
from batchinfer.structured.bitmask import allocate_token_bitmask, apply_token_bitmask_, unpack_bitmask
from batchinfer.structured.compiler import GrammarCompiler, check_constraint, truncation_error
from batchinfer.structured.outlines_backend import OutlinesLimits, outlines_unsupported
from batchinfer.structured.registry import CompileLimits
from batchinfer.structured.validate import validate_output
from batchinfer.structured.vocab import vocab_from_hf, vocab_from_qwen_tiktoken

EXAMPLES = Path(__file__).resolve().parent.parent / "schemas" / "examples"
VOCAB = 520  # a few padding rows past the 512-token tokenizer: never allowed


@pytest.fixture(scope="module")
def compilers(tokenizer):
    shared: dict = {}
    names = ("auto", "llguidance", "xgrammar", "outlines", "llguidance-relaxed")
    return {n: GrammarCompiler(tokenizer, VOCAB, n, shared_backends=shared) for n in names}


def allowed_ids(bitmask: torch.Tensor, vocab_size: int) -> np.ndarray:
    return unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().numpy()


def walk(compiler: GrammarCompiler, grammar, rng: np.random.Generator, cap: int) -> tuple[str | None, list[int]]:
    """Random walk over the bitmask; (text, ids) when terminated, (None, ids) at the cap."""
    vocab = compiler.vocab
    m = grammar.new_matcher()
    bm = allocate_token_bitmask(1, vocab.vocab_size)
    ids: list[int] = []
    for _ in range(cap):
        m.fill_next_token_bitmask(bm, 0)
        allowed = allowed_ids(bm, vocab.vocab_size)
        assert allowed.size, f"empty mask after {vocab.decode(ids)!r}"
        assert all(vocab.is_normal(int(t)) or int(t) in vocab.eos_ids for t in allowed), "special/padding id allowed"
        tok = int(rng.choice(allowed))
        assert m.accept_token(tok), f"token {tok} in the mask was refused"
        ids.append(tok)
        if m.is_terminated():
            return vocab.decode([i for i in ids if i not in vocab.eos_ids]), ids
    return None, ids


def example_schemas() -> list[tuple[str, dict]]:
    return [(p.stem, json.loads(p.read_text())) for p in sorted(EXAMPLES.glob("*.json"))]


# --- vocabulary -----------------------------------------------------------------------------


def test_vocab_from_hf_spells_text_and_can_express_any_json(tokenizer):
    v = vocab_from_hf(tokenizer, VOCAB)
    assert v.vocab_size == VOCAB and v.eos_ids == (tokenizer.eos_token_id,)
    for text in ['{"a": "café 日本 😀", "b": [1, -2.5e3, true, null]}', "\\n\"\t"]:
        assert b"".join(v.token_bytes[i] for i in v.encode(text)) == text.encode()
    singles = {b for b in v.token_bytes if len(b) == 1}
    assert singles == {bytes([i]) for i in range(256)}  # every byte has a token: any JSON is expressible
    assert all(v.token_bytes[i] == b"" for i in range(len(tokenizer), VOCAB))
    assert all(not v.is_normal(i) for i in tokenizer.all_special_ids)


def test_vocab_from_qwen_tiktoken():
    v = vocab_from_qwen_tiktoken()
    assert v.vocab_size == 151936 and v.eos_ids == (151645, 151643)
    text = '{"名前":"Größe","n":[1,2]}'
    assert b"".join(v.token_bytes[i] for i in v.encode(text)) == text.encode()
    assert not v.is_normal(151645) and v.token_bytes[151900] == b""


# --- bitmask --------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1, 31, 32, 100, 517])
def test_apply_token_bitmask_matches_loop(vocab):
    g = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    logits = torch.randn(3, vocab, generator=g)
    expect = logits.clone()
    for b in range(3):
        for t in range(vocab):
            if not (int(bitmask[b, t // 32]) >> (t % 32)) & 1:
                expect[b, t] = float("-inf")
    apply_token_bitmask_(logits, bitmask)
    assert torch.equal(logits, expect)


def test_apply_token_bitmask_disallows_ids_past_the_mask():
    logits = torch.zeros(1, 70)
    apply_token_bitmask_(logits, torch.full((1, 2), -1, dtype=torch.int32))
    assert torch.isinf(logits[0, 64:]).all() and torch.isfinite(logits[0, :64]).all()
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask_(logits, torch.zeros(1, 3, dtype=torch.int64))


# --- random walks ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,schema", example_schemas())
def test_auto_random_walk_terminates_and_validates(compilers, name, schema):
    c = Constraint.json_schema(schema)
    comp = compilers["auto"]
    grammar = comp.compile(c)
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # not hash(): it changes from process to process
    for _ in range(6):
        text, ids = walk(comp, grammar, rng, cap=400)
        assert text is not None, f"{name}: bounded schema did not terminate: {comp.vocab.decode(ids)[:200]!r}"
        value, err = validate_output(c, text)
        assert err is None, f"{name}: {text!r}: {err}"


# schemas each backend enforces in full (others: the post-decoding validation catches the rest)
EXACT = {
    "xgrammar": ["enum_const", "bounded_numbers", "top_level_array", "any_of", "optional_fields"],
    "outlines": ["enum_const", "string_lengths", "bounded_array", "nested_object", "unicode_strings"],
    "llguidance": [n for n, _ in example_schemas()],
}


@pytest.mark.parametrize("backend", sorted(EXACT))
def test_each_backend_random_walk_validates(compilers, backend):
    comp = compilers[backend]
    rng = np.random.default_rng(7)
    for name, schema in example_schemas():
        if name not in EXACT[backend]:
            continue
        c = Constraint.json_schema(schema)
        grammar = comp.compile(c)
        assert grammar.backend == backend
        for _ in range(4):
            text, _ = walk(comp, grammar, rng, cap=400)
            if text is not None:
                assert validate_output(c, text)[1] is None, f"{backend} {name}: {text!r}"


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_regex_and_choice_walks(compilers, backend):
    comp = compilers[backend]
    rng = np.random.default_rng(3)
    for c in (Constraint.regex(r"[A-Z]{2}-[0-9]{3}( ok)?"), Constraint.choice(["yes", "no", "maybe so", "日本"])):
        grammar = comp.compile(c)
        seen = set()
        for _ in range(12):
            text, ids = walk(comp, grammar, rng, cap=50)
            assert text is not None, comp.vocab.decode(ids)
            assert validate_output(c, text) == (text, None), text
            seen.add(text)
        assert len(seen) > 1


# --- matcher behaviour ----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_eos_only_at_the_end_and_rollback(compilers, backend):
    comp = compilers[backend]
    v = comp.vocab
    c = Constraint.json_schema({"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"],
                                "additionalProperties": False})
    m = comp.compile(c).new_matcher()
    bm = allocate_token_bitmask(1, VOCAB)
    ids = v.encode('{"a":"yy"}')
    masks = []
    for t in ids:
        m.fill_next_token_bitmask(bm, 0)
        masks.append(bm.clone())
        assert v.eos_id not in allowed_ids(bm, VOCAB)
        assert m.accept_token(t)
    m.fill_next_token_bitmask(bm, 0)
    assert v.eos_id in allowed_ids(bm, VOCAB)
    assert not m.accept_token(v.encode("x")[0])  # nothing may follow the object
    assert m.accept_token(v.eos_id) and m.is_terminated()
    m.rollback(3)  # EOS, '}' and the token before it
    m.fill_next_token_bitmask(bm, 0)
    assert torch.equal(bm, masks[-2])
    assert not m.is_terminated()
    for t in ids[-2:]:
        assert m.accept_token(t)
    assert m.accept_token(v.eos_id)


def test_batch_fill_matches_row_fills(compilers):
    comp = compilers["auto"]
    v = comp.vocab
    grammars = [comp.compile(Constraint.json_schema(s)) for _, s in example_schemas()[:4]]
    grammars.append(compilers["xgrammar"].compile(Constraint.regex("[a-z]+")))
    grammars.append(compilers["outlines"].compile(Constraint.choice(["ab", "cd"])))
    matchers = [g.new_matcher() for g in grammars]
    for m in matchers[:4]:
        assert m.accept_token(v.encode("{")[0])
    rows = list(range(len(matchers)))[::-1]
    one = allocate_token_bitmask(len(matchers), VOCAB)
    for m, r in zip(matchers, rows):
        m.fill_next_token_bitmask(one, r)
    many = allocate_token_bitmask(len(matchers), VOCAB)
    comp.fill_next_token_bitmasks(matchers, many, rows)
    assert torch.equal(one, many)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar", "outlines"])
def test_matchers_of_one_grammar_are_independent(compilers, backend):
    """Matchers of one compiled grammar share nothing visible (llguidance hands out deep copies of
    one prototype): advancing and ending one leaves the others at the start, and a later matcher
    starts from the start too."""
    comp = compilers[backend]
    v = comp.vocab
    g = comp.compile(Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
                                             "required": ["a"], "additionalProperties": False}))
    first, second = g.new_matcher(), g.new_matcher()
    start = allocate_token_bitmask(1, VOCAB)
    second.fill_next_token_bitmask(start, 0)
    for tok in v.encode('{"a":"xy"}'):
        assert first.accept_token(tok)
    assert not second.is_terminated()
    for m in (second, g.new_matcher()):
        got = allocate_token_bitmask(1, VOCAB)
        m.fill_next_token_bitmask(got, 0)
        assert torch.equal(got, start)
    for tok in v.encode('{"a":"zzz"}'):
        assert second.accept_token(tok)


def test_fill_threads_size_the_pools_and_the_prototypes(tokenizer):
    """GrammarCompiler(fill_threads=N): llguidance's pool has N threads and each grammar N matcher
    prototypes, handed out in turn; fills and accepts still match one row at a time."""
    comp = GrammarCompiler(tokenizer, VOCAB, "llguidance", fill_threads=3)
    assert comp.backend("llguidance").fill_threads() == 3
    g = comp.compile(Constraint.regex("[a-c]{1,4}"))
    assert g.groups == 3
    ms = [g.new_matcher() for _ in range(7)]
    assert [m.group for m in ms] == [0, 1, 2, 0, 1, 2, 0]
    v = comp.vocab
    assert all(comp.accept_tokens(ms, [v.encode("a")[0]] * 7))
    many = allocate_token_bitmask(7, VOCAB)
    comp.fill_next_token_bitmasks(ms, many, list(range(7)))
    one = allocate_token_bitmask(1, VOCAB)
    ms[0].fill_next_token_bitmask(one, 0)
    assert all(torch.equal(many[i], one[0]) for i in range(7))


def test_whitespace_modes(compilers):
    comp = compilers["llguidance"]
    v = comp.vocab
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def accepts(c: Constraint, text: str) -> bool:
        m = comp.compile(c).new_matcher()
        return all(m.accept_token(t) for t in v.encode(text)) and m.accept_token(v.eos_id)

    for backend in ("llguidance", "xgrammar", "outlines"):
        comp = compilers[backend]
        assert accepts(Constraint.json_schema(schema), '{"a":1}')
        assert not accepts(Constraint.json_schema(schema), '{"a": 1}'), backend
        assert accepts(Constraint.json_schema(schema, whitespace="flexible"), '{ "a": 1 }'), backend
        assert not accepts(Constraint.json_schema(schema, whitespace="flexible"), '{"a":' + " " * 40 + "1}"), backend


# --- compile, fallback, refusal, cache ------------------------------------------------------


def test_auto_falls_back_when_a_backend_refuses(compilers):
    schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}, "required": ["a"]}
    c = Constraint.json_schema(schema)
    with pytest.raises(GrammarError, match="not"):
        compilers["llguidance"].compile(c)
    g = compilers["auto"].compile(c)
    assert g.backend != "llguidance"
    one_of = Constraint.json_schema({"oneOf": [{"type": "string", "maxLength": 3}, {"type": "string", "minLength": 2}]})
    with pytest.raises(GrammarError, match="oneOf"):
        compilers["llguidance"].compile(one_of)
    assert compilers["auto"].compile(one_of).backend in ("xgrammar", "llguidance-relaxed")


def test_refused_before_the_run_naming_the_construct(tokenizer):
    with pytest.raises(GrammarError, match=r"properties/a/type"):
        check_constraint(Constraint.json_schema({"properties": {"a": {"type": "objekt"}}}), tokenizer, VOCAB)
    with pytest.raises(GrammarError) as e:
        check_constraint(Constraint.regex(r"(a)\1"), tokenizer, VOCAB)
    assert "llguidance" in str(e.value) and "xgrammar" in str(e.value) and "outlines" in str(e.value)
    with pytest.raises(GrammarError, match="invalid regex"):
        check_constraint(Constraint.regex("(a"), tokenizer, VOCAB)
    check_constraint(Constraint.choice(["a", "b"]), tokenizer, VOCAB)
    with pytest.raises(ValueError, match="grammar backend"):
        GrammarCompiler(tokenizer, VOCAB, "nope")


def test_outlines_limits_and_auto_skips(tokenizer):
    slow = GrammarCompiler(tokenizer, VOCAB, "outlines", limits=CompileLimits(outlines=OutlinesLimits(timeout_s=0.001)))
    with pytest.raises(GrammarError, match="within"):
        slow.compile(Constraint.regex("[a-z]{3}"))
    short = GrammarCompiler(tokenizer, VOCAB, "outlines", limits=CompileLimits(outlines=OutlinesLimits(max_regex_chars=10)))
    with pytest.raises(GrammarError, match="regex"):
        short.compile(Constraint.json_schema({"type": "object", "properties": {"abc": {"type": "string"}}}))
    c = Constraint.json_schema({"type": "integer", "minimum": 3})
    assert outlines_unsupported(c) == "minimum"
    assert outlines_unsupported(Constraint.json_schema({"type": "string", "maxLength": 3})) is None


def test_disk_cache_round_trip(tokenizer, tmp_path):
    c = Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    for backend in ("xgrammar", "outlines"):
        first = GrammarCompiler(tokenizer, VOCAB, backend, cache_dir=tmp_path)
        first.compile(c)
        files = list(tmp_path.glob(f"{backend}-*.bin"))
        assert len(files) == 1
        again = GrammarCompiler(tokenizer, VOCAB, backend, cache_dir=tmp_path)
        m = again.compile(c).new_matcher()
        assert all(m.accept_token(t) for t in again.vocab.encode('{"n":12}'))
        assert m.accept_token(again.vocab.eos_id)
        files[0].write_bytes(b"torn")  # a damaged entry is rebuilt, not fatal
        GrammarCompiler(tokenizer, VOCAB, backend, cache_dir=tmp_path).compile(c)


def test_validate_output_names_path_and_validator():
    c = Constraint.json_schema({"type": "object", "properties": {"items": {"type": "array", "items": {
        "type": "object", "properties": {"age": {"type": "integer", "maximum": 120}}}}}})
    assert validate_output(c, '{"items":[{"age":3}]}') == ({"items": [{"age": 3}]}, None)
    value, err = validate_output(c, '{"items":[{"age":3},{"age":500}]}')
    assert value is None and "$.items[1].age" in err and "maximum" in err
    value, err = validate_output(c, '{"items":[{"age":3')
    assert value is None and "not valid JSON" in err
    assert validate_output(Constraint.regex("[0-9]+"), "12a")[1] is not None
    assert validate_output(Constraint.choice(["a", "b"]), "c")[1] is not None
    assert "cut at the token limit (max_tokens=5)" in truncation_error(c, '{"items":[', 5)


# --- Arrow -----------------------------------------------------------------------------------


def test_arrow_types():
    schema = json.loads((EXAMPLES / "ref_defs.json").read_text())
    t = arrow_type_for_schema(schema)
    item = pa.struct([pa.field("sku", pa.string()), pa.field("qty", pa.int64())])
    assert t == pa.struct([pa.field("items", pa.list_(item)), pa.field("main", item)])
    assert arrow_type_for_schema({"type": "array", "items": {"type": "number"}}) == pa.list_(pa.float64())
    assert arrow_type_for_schema({"anyOf": [{"type": "integer"}, {"type": "string"}]}) is None
    assert arrow_type_for_schema({"anyOf": [{"type": "integer"}, {"type": "null"}]}) == pa.int64()
    assert arrow_type_for_schema({"type": "object", "additionalProperties": {"type": "integer"}}) is None
    assert arrow_type_for_schema({"enum": ["a", "b"]}) == pa.string()
    loop = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}
    assert arrow_type_for_schema(loop) == pa.struct([pa.field("next", pa.string())])
    values = [{"items": [{"sku": "a", "qty": 1}], "main": {"sku": "b", "qty": 2}}, {"items": [], "main": {"sku": "c"}}]
    arr = pa.array([to_arrow_value(v, schema) for v in values], type=t)
    assert arr.to_pylist()[1] == {"items": [], "main": {"sku": "c", "qty": None}}
    assert to_arrow_value({"x": 1}, {"anyOf": [{"type": "integer"}, {"type": "object"}]}) == '{"x":1}'


def test_property_order_is_the_schema_order(compilers):
    schema = {"type": "object", "properties": {"reasoning": {"enum": ["r"]}, "answer": {"enum": ["a"]}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    c = Constraint.json_schema(schema)
    text, _ = walk(compilers["auto"], compilers["auto"].compile(c), np.random.default_rng(0), cap=100)
    assert text == '{"reasoning":"r","answer":"a"}'


# --- the backend interface ------------------------------------------------------------------


def test_every_backend_implements_the_whole_interface(compilers):
    """What callers use of a backend is declared in structured/base.py; each one has all of it, and
    its matchers name the backend that batches them."""
    from batchinfer.structured.registry import BACKENDS, VARIANTS

    comp = compilers["auto"]
    c = Constraint.choice(["ab", "cd"])
    for name in (*BACKENDS, *VARIANTS):
        b = comp.backend(name)
        assert b.name == name and isinstance(b.fills_in_background, bool)
        assert b.library is None or isinstance(b.library, str)
        for method in ("supports", "compile", "deserialize", "fill_call", "finish_rows", "accept_tokens"):
            assert callable(getattr(b, method)), (name, method)
        assert b.supports(c) is None
        m = b.compile(c).new_matcher()
        assert comp.backend(m.backend) is not None
        for method in ("fill_next_token_bitmask", "accept_token", "is_terminated", "rollback"):
            assert callable(getattr(m, method)), (name, method)


def test_a_backend_says_what_it_will_not_compile_as_a_fallback(compilers):
    """outlines-core steps aside in auto where it would not enforce the schema; asked by name it tries."""
    outlines = compilers["outlines"].backend("outlines")
    c = Constraint.json_schema({"type": "integer", "minimum": 3})
    assert outlines.supports(c, fallback=True) == "outlines-core does not enforce minimum"
    assert outlines.supports(c) is None
    big = Constraint.json_schema({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(60)}})
    assert "too complex" in outlines.supports(big, fallback=True)


class _CountingBackend:
    """A backend that counts the batch calls it gets and passes them on."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def fill_call(self, matchers, bitmask, indices):
        self.calls.append(("fill", len(matchers)))
        return self.inner.fill_call(matchers, bitmask, indices)

    def accept_tokens(self, matchers, tokens):
        self.calls.append(("accept", len(matchers)))
        return self.inner.accept_tokens(matchers, tokens)


def test_batch_calls_go_to_the_backend_the_matcher_names(compilers):
    """The compiler groups matchers by GrammarMatcher.backend, one call per backend per step, whatever
    the matcher's class."""
    real = compilers["outlines"].backend("outlines")
    counting = _CountingBackend(real)
    comp = GrammarCompiler(compilers["auto"].vocab, VOCAB, "outlines", shared_backends={"outlines": counting})
    g = comp.compile(Constraint.choice(["ab", "cd"]))
    ms = [g.new_matcher() for _ in range(3)]
    v = comp.vocab
    assert comp.accept_tokens(ms, [v.encode("ab")[0]] * 3) == [True] * 3
    comp.fill_next_token_bitmasks(ms, allocate_token_bitmask(3, VOCAB), [0, 1, 2])
    assert counting.calls == [("accept", 3), ("fill", 3)]


class _PieceTokenizer:
    """The parts of a Hugging Face tokenizer vocab_from_hf reads, over a given list of pieces."""

    def __init__(self, pieces, special=()):
        self.pieces, self.all_special_ids, self.eos_token_id = list(pieces), list(special), 0
        self.added_tokens_decoder = {}

    def __len__(self):
        return len(self.pieces)

    def convert_ids_to_tokens(self, ids):
        return [self.pieces[i] for i in ids]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=6), min_size=1, max_size=40))
def test_vocab_from_hf_byte_level_pieces_become_their_bytes(tokens):
    from batchinfer.real_tokenizer import bytes_to_unicode

    spell = bytes_to_unicode()
    pieces = ["<|end|>", *("".join(spell[b] for b in t) for t in tokens)]
    v = vocab_from_hf(_PieceTokenizer(pieces, special=[0]), len(pieces) + 3)
    assert v.token_bytes == (b"", *tokens, b"", b"", b"")


def test_vocab_from_hf_reads_sentencepiece_pieces():
    pieces = ["<s>", "\u2581hello", "<0x0A>", "wor", "\u00e9t\u00e9", None]
    v = vocab_from_hf(_PieceTokenizer(pieces, special=[0]), 6)
    assert v.token_bytes == (b"", b" hello", b"\n", b"wor", "\u00e9t\u00e9".encode(), b"")
