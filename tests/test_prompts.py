"""Prompt rendering: sandboxed Jinja over a row, strict about missing/null/non-scalar columns."""

from __future__ import annotations

import pytest

from batchinfer.job.spec import JobError, PromptSpec
from batchinfer.job.prompts import PromptBuilder, RowError


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from batchinfer.models.loader import load_tokenizer

    return load_tokenizer(tiny_model)


def test_chat_prompt_uses_the_model_template(tokenizer):
    b = PromptBuilder(PromptSpec(template="Doc: {{ text }} ({{ n }})", system="Be brief."), tokenizer)
    assert b.chat and b.columns == ["n", "text"]
    text, ids = b.encode({"text": "hello", "n": 3, "other": [1]})
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nDoc: hello (3)<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == text


def test_plain_prompt_without_chat(tokenizer):
    b = PromptBuilder(PromptSpec(template="Q: {{ q }}", system="S", chat=False), tokenizer)
    text, ids = b.encode({"q": "why"})
    assert text == "S\n\nQ: why" and tokenizer.decode(ids) == text


@pytest.mark.parametrize(
    "row, message",
    [
        ({}, "template column 'text' is missing"),
        ({"text": None}, "template column 'text' is null"),
        ({"text": ["a"]}, "template column 'text' is not a string or number (got list)"),
        ({"text": {"a": 1}}, "not a string or number (got dict)"),
        ({"text": b"x"}, "(got bytes)"),
    ],
)
def test_bad_rows_raise_row_errors_naming_the_column(tokenizer, row, message):
    b = PromptBuilder(PromptSpec(template="{{ text }}"), tokenizer)
    with pytest.raises(RowError) as e:
        b.encode(row)
    assert message in str(e.value)


def test_sandbox_blocks_attribute_tricks(tokenizer):
    b = PromptBuilder(PromptSpec(template="{{ text.__class__.__mro__ }}"), tokenizer)
    with pytest.raises(RowError):
        b.encode({"text": "x"})


def test_syntax_error_is_a_job_error(tokenizer):
    with pytest.raises(JobError, match="Jinja syntax error on line 1"):
        PromptBuilder(PromptSpec(template="{{ text "), tokenizer)


def test_chat_true_without_a_chat_template_is_a_job_error(tokenizer):
    class NoChat:
        chat_template = None

    with pytest.raises(JobError, match="no chat template"):
        PromptBuilder(PromptSpec(template="x", chat=True), NoChat())
