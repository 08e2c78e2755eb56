"""Grammar-state keys (structured/state_keys.py): rows with equal keys have equal llguidance masks.

Random walks through each schema's grammar (every step a token drawn from the row's own mask, with a
bias towards closing strings and structure so walks cover whole answers) on the demo vocabulary and
on the real Qwen vocabulary; every mask is compared with the first mask seen for its key. Schemas
cover the free strings the keys coarsen, the numbers they elide, and the positions they must leave
as written (object keys, enums, patterns, anyOf, $ref, optional properties, flexible
whitespace). Plus the byte machine on hand-written texts.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from batchinfer.bench.workloads import DOCS_SCHEMA
from batchinfer.structured.base import Constraint
from batchinfer.structured.bitmask import unpack_bitmask
from batchinfer.structured.compiler import GrammarCompiler
from batchinfer.structured.state_keys import SchemaKeys, _pending_utf8

S = {"type": "string"}
SCHEMAS = {
    "docs": DOCS_SCHEMA,
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 9, "minLength": 2},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "addr": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 7}, "zip": {"type": "string", "pattern": "[0-9]{3}"}},
                 "required": ["city", "zip"], "additionalProperties": False},
        "ok": {"type": "boolean"}, "none": {"type": "null"},
    }, "required": ["name", "age", "tags", "addr", "ok"], "additionalProperties": False},
    "opaque": {"type": "object", "properties": {
        "r": {"$ref": "#/$defs/short"},
        "kind": {"enum": ["a", "bb", "ccc"]},
        "v": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "integer"}]},
        "u": {"type": "array", "items": {"type": "string", "pattern": "[a-c]{1,3}"}, "maxItems": 3},
        "t": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 4}], "items": False},
    }, "required": ["r", "kind", "v", "u", "t"], "additionalProperties": False,
        "$defs": {"short": {"type": "string", "maxLength": 6}}},
    "free-form": {"type": "object", "properties": {"a": S}, "additionalProperties": {"type": "string", "maxLength": 3}},
    "top-array": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 99},
                                                                            "y": {"type": "string", "maxLength": 4}},
                                             "required": ["x", "y"], "additionalProperties": False}, "maxItems": 4},
}


def _walk(compiler: GrammarCompiler, constraint: Constraint, rows: int, steps: int, seed: int) -> tuple[int, int]:
    """(rows keyed, rows whose key was seen before for another text); asserts equal masks for equal keys."""
    grammar = compiler.compile(constraint)
    vocab = compiler.vocab
    keys = SchemaKeys(constraint.schema)
    rng = random.Random(seed)
    words = (vocab.vocab_size + 31) // 32
    seen: dict = {}
    keyed = repeats = 0
    live = [(grammar.new_matcher(), keys.start(), b"") for _ in range(rows)]
    closers = torch.tensor([i for i, b in enumerate(vocab.token_bytes) if vocab.is_normal(i) and b and b[:1] in b'"}],0123456789'])
    for _ in range(steps):
        if not live:
            break
        mask = torch.full((len(live), words), -1, dtype=torch.int32)
        for r, (m, _, _) in enumerate(live):
            m.fill_next_token_bitmask(mask, r)
        allowed = unpack_bitmask(mask, vocab.vocab_size)
        nxt = []
        for r, (m, track, text) in enumerate(live):
            key = track.key()
            if key is not None:
                keyed += 1
                if key in seen:
                    repeats += seen[key][1] != text
                    assert torch.equal(seen[key][0], mask[r]), f"key {key!r} for {text!r} and {seen[key][1]!r}"
                else:
                    seen[key] = (mask[r].clone(), text)
            near = closers[allowed[r][closers]].tolist()
            token = rng.choice(near) if near and rng.random() < 0.3 else _draw(allowed[r], rng)
            if not m.accept_token(token) or m.is_terminated():
                continue
            data = vocab.token_bytes[token] if vocab.is_normal(token) else b""
            track.feed(data)
            nxt.append((m, track, text + data))
        live = nxt
    return keyed, repeats


def _draw(allowed: torch.Tensor, rng: random.Random) -> int:
    """A uniformly drawn allowed token (a few random probes first: listing 151k ids is slow)."""
    for _ in range(16):
        i = rng.randrange(len(allowed))
        if allowed[i]:
            return i
    return rng.choice(allowed.nonzero().flatten().tolist())


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_equal_keys_have_equal_masks(tokenizer, name, whitespace):
    compiler = GrammarCompiler(tokenizer, len(tokenizer), "llguidance")
    keyed, repeats = _walk(compiler, Constraint.json_schema(SCHEMAS[name], whitespace), rows=24, steps=60, seed=len(name))
    assert keyed > 0
    if whitespace == "compact" and name != "free-form":  # (free whitespace or property names: walks rarely meet)
        assert repeats > 0  # the walk exercised keys shared by different texts


@pytest.mark.slow
def test_equal_keys_have_equal_masks_on_the_qwen_vocabulary(tmp_path):
    """The benchmark schema on the real 151,936-token vocabulary: most rows share a key."""
    from batchinfer.bench.shapes import write_shape
    from batchinfer.models.loader import load_tokenizer

    tok = load_tokenizer(write_shape("qwen3-0.6b", tmp_path / "qwen"))
    compiler = GrammarCompiler(tok, len(tok), "llguidance")
    keyed, repeats = _walk(compiler, Constraint.json_schema(DOCS_SCHEMA), rows=24, steps=60, seed=1)
    assert repeats > keyed // 3


def _key_after(schema, text: bytes, pieces: int = 3):
    """The key after feeding `text` in `pieces` chunks (and one byte at a time: the same key)."""
    keys = SchemaKeys(schema)
    a, b = keys.start(), keys.start()
    step = max(1, len(text) // pieces)
    for i in range(0, len(text), step):
        a.feed(text[i:i + step])
    for i in range(len(text)):
        b.feed(text[i:i + 1])
    assert a.key() == b.key()
    return a.key()


def test_keys_coarsen_free_strings_and_numbers_only():
    """In progress: free strings by count, everything else as written; complete: scalar values of
    followed containers elided."""
    docs = SCHEMAS["nested"]
    # inside a free string: count and pending bytes, not content
    assert _key_after(docs, b'{"name":"abc') == _key_after(docs, b'{"name":"xyz')
    assert _key_after(docs, b'{"name":"ab') != _key_after(docs, b'{"name":"xyz')
    assert _key_after(docs, "{\"name\":\"é".encode()) == _key_after(docs, b'{"name":"q')
    assert _key_after(docs, "{\"name\":\"é".encode()[:-1]) != _key_after(docs, b'{"name":"')
    # an escape: the text as written until the string closes, then elided
    assert _key_after(docs, b'{"name":"a\\n') != _key_after(docs, b'{"name":"ab')
    assert _key_after(docs, b'{"name":"a\\n","age":') == _key_after(docs, b'{"name":"zz","age":')
    # numbers: written while in progress, elided once complete
    assert _key_after(docs, b'{"name":"a","age":1') != _key_after(docs, b'{"name":"a","age":7')
    assert _key_after(docs, b'{"name":"a","age":12,') == _key_after(docs, b'{"name":"bb","age":7,')
    # object keys and pattern strings stay as written
    assert _key_after(docs, b'{"name":"a","age":1,"tags":["x"],"addr":{"city":"c","zip":"12') != \
        _key_after(docs, b'{"name":"a","age":1,"tags":["x"],"addr":{"city":"c","zip":"45')
    opaque = SCHEMAS["opaque"]
    assert _key_after(opaque, b'{"r":"","kind":"bb","v":"ab') != _key_after(opaque, b'{"r":"","kind":"bb","v":"cd')
    assert _key_after(opaque, b'{"r":"abc') == _key_after(opaque, b'{"r":"xyz')
    assert _key_after(opaque, b'{"r":"a","kind":"a","v":1,"u":["ab') != _key_after(opaque, b'{"r":"","kind":"a","v":1,"u":["cd')
    # complete enum, pattern, anyOf and literal values of a followed container: elided
    assert _key_after(opaque, b'{"r":"","kind":"bb",') == _key_after(opaque, b'{"r":"","kind":"ccc",')
    assert _key_after(opaque, b'{"r":"","kind":"a","v":"ab",') == _key_after(opaque, b'{"r":"","kind":"a","v":"c",')
    assert _key_after(opaque, b'{"r":"","kind":"a","v":3,') == _key_after(opaque, b'{"r":"","kind":"a","v":17,')
    assert _key_after(opaque, b'{"r":"","kind":"a","v":1,"u":["ab","c"') == _key_after(opaque, b'{"r":"","kind":"a","v":1,"u":["b","a"')
    assert _key_after(docs, b'{"name":"a","age":1,"tags":["x"],"addr":{"city":"c","zip":"123"},"ok":true,') == \
        _key_after(docs, b'{"name":"b","age":2,"tags":["y"],"addr":{"city":"d","zip":"456"},"ok":false,')
    # ... but not the item count, and not in a container it does not follow
    assert _key_after(opaque, b'{"r":"","kind":"a","v":1,"u":["ab",') != _key_after(opaque, b'{"r":"","kind":"a","v":1,"u":[')
    unique = {"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": True}
    assert _key_after(unique, b'["a",') != _key_after(unique, b'["b",')
    # text that is not this JSON: no key
    assert _key_after(docs, b'{"name"]') is None


def test_pending_utf8():
    e = "é".encode()
    han = "日".encode()
    assert _pending_utf8(bytearray(b"ab")) == b""
    assert _pending_utf8(bytearray(b"a" + e[:1])) == e[:1]
    assert _pending_utf8(bytearray(b"a" + e)) == b""
    assert _pending_utf8(bytearray(han[:2])) == han[:2]
    assert _pending_utf8(bytearray("😀".encode()[:3])) == "😀".encode()[:3]


def test_schema_positions():
    keys = SchemaKeys(json.loads(json.dumps(SCHEMAS["opaque"])))
    root = keys.resolve(keys.root)
    assert keys.is_free_string(keys.child_of_object(root, b"r"))  # through the $ref
    assert not keys.is_free_string(keys.child_of_object(root, b"v"))  # anyOf
    assert keys.child_of_object(root, b"nope") is None  # additionalProperties: false
    t = keys.child_of_object(root, b"t")
    assert keys.is_plain_number(keys.child_of_array(t, 0)) and keys.is_free_string(keys.child_of_array(t, 1))
    assert keys.child_of_array(t, 2) is None
    assert not keys.is_free_string(keys.child_of_array(keys.child_of_object(root, b"u"), 0))  # a pattern
    unique = SchemaKeys({"type": "array", "items": {"type": "string"}, "uniqueItems": True})
    assert unique.child_of_array(unique.resolve(unique.root), 0) is None  # items that depend on each other
