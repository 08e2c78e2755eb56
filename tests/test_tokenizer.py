"""models.tokenizer.FastTokenizer against transformers' tokenizer on the same files: every method the
engine and the job use, on the demo tokenizer, the real SmolLM2 one and the Qwen vocabulary of the
bench shapes; and load_tokenizer's choice (FastTokenizer where it reads a folder exactly, else
transformers)."""

from __future__ import annotations

import json
import pickle
import random
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.models.loader import load_tokenizer
from batchinfer.models.tokenizer import FastTokenizer, unsupported

TEXTS = ["Hello world", " leading space", "<|im_start|>user\nhi<|im_end|>", "naïve café 東京 🙂\n\ttabs", "", "12,345.67 {\"a\": [1]}"]
MESSAGES = [
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": 'Say "hi" & <b>'}],
    [{"role": "user", "content": "Only a question?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model, smollm2):
    from batchinfer.bench.shapes import write_shape

    qwen = write_shape("qwen3-0.6b", tmp_path_factory.mktemp("shape") / "qwen3-0.6b")
    return {"demo": tiny_model, "smollm2": smollm2, "qwen": qwen}


@pytest.fixture(scope="module")
def pairs(folders):
    from transformers import AutoTokenizer

    return {name: (AutoTokenizer.from_pretrained(str(f)), FastTokenizer(f)) for name, f in folders.items()}


NAMES = ["demo", "smollm2", "qwen"]


@pytest.mark.parametrize("name", NAMES)
def test_vocabulary_and_special_tokens_match_transformers(pairs, name):
    hf, fast = pairs[name]
    assert len(fast) == len(hf) and fast.vocab_size == hf.vocab_size
    for attr in ("eos_token_id", "pad_token_id", "bos_token_id", "unk_token_id", "eos_token", "pad_token"):
        assert getattr(fast, attr) == getattr(hf, attr), attr
    assert sorted(fast.all_special_ids) == sorted(hf.all_special_ids)
    ids = list(range(len(hf)))
    assert fast.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert fast.get_vocab() == hf.get_vocab()
    assert {i: t.special for i, t in fast.added_tokens_decoder.items()} == {i: t.special for i, t in hf.added_tokens_decoder.items()}


@pytest.mark.parametrize("name", NAMES)
def test_encoding_single_and_batched_matches_transformers(pairs, name):
    hf, fast = pairs[name]
    for special in (True, False):
        for text in TEXTS:
            assert fast(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"], text
            assert fast.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        assert fast(TEXTS, add_special_tokens=special)["input_ids"] == hf(TEXTS, add_special_tokens=special)["input_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_decoding_matches_transformers(pairs, name):
    hf, fast = pairs[name]
    rng = random.Random(name)
    for _ in range(300):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(0, 24))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("name", NAMES)
def test_chat_template_renders_like_transformers(pairs, name):
    hf, fast = pairs[name]
    assert (fast.chat_template is None) == (hf.chat_template is None)
    for messages in MESSAGES:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == want


@settings(max_examples=40, deadline=None)
@given(text=st.text(max_size=60), system=st.one_of(st.none(), st.text(max_size=20)))
def test_any_text_encodes_and_renders_like_transformers(pairs, text, system):
    hf, fast = pairs["smollm2"]
    assert fast(text, add_special_tokens=False)["input_ids"] == hf(text, add_special_tokens=False)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
    assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert fast.apply_chat_template(messages, add_generation_prompt=True) == hf.apply_chat_template(
        messages, add_generation_prompt=True)


def test_load_tokenizer_takes_fast_where_exact_and_transformers_elsewhere(folders, tmp_path):
    assert isinstance(load_tokenizer(folders["smollm2"]), FastTokenizer)
    odd = tmp_path / "odd"
    shutil.copytree(folders["demo"], odd)
    cfg = json.loads((odd / "tokenizer_config.json").read_text())
    cfg["add_bos_token"] = True
    (odd / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert "add_bos_token" in unsupported(odd)
    tok = load_tokenizer(odd)
    assert not isinstance(tok, FastTokenizer) and len(tok) == len(FastTokenizer(folders["demo"]))


def test_pickles_and_renders_after(pairs):
    _, fast = pairs["demo"]
    fast.apply_chat_template(MESSAGES[0], tokenize=False)  # compiles the template, which pickling leaves out
    copy = pickle.loads(pickle.dumps(fast))
    assert copy.apply_chat_template(MESSAGES[0], tokenize=False) == fast.apply_chat_template(MESSAGES[0], tokenize=False)
    assert copy(TEXTS)["input_ids"] == fast(TEXTS)["input_ids"]
