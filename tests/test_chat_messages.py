"""Chat input: `prompt.messages` names a column of {role, content} turns, rendered with the model's chat template."""

from __future__ import annotations

import json

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.job.spec import JobError, PromptSpec, load_job
from batchinfer.job.prompts import PromptBuilder, RowError


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from batchinfer.models.loader import load_tokenizer

    return load_tokenizer(tiny_model)


def expected(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_any_number_of_turns_renders_with_the_chat_template(tokenizer):
    b = PromptBuilder(PromptSpec(messages="messages"), tokenizer)
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    text, ids = b.encode({"messages": turns})
    assert text == expected(tokenizer, turns)
    assert text.count("<|im_start|>user") == 2 and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(ids) == text and b.columns == ["messages"]


def test_job_system_prompt_is_prepended_unless_the_messages_have_one(tokenizer):
    b = PromptBuilder(PromptSpec(messages="conv", system="You are {{ who }}."), tokenizer)
    user = [{"role": "user", "content": "q"}]
    assert b.prompt({"conv": user, "who": "terse"}) == expected(tokenizer, [{"role": "system", "content": "You are terse."}, *user])
    own = [{"role": "developer", "content": "Mine."}, *user]  # developer is OpenAI's newer name for system
    assert b.prompt({"conv": own, "who": "x"}) == expected(tokenizer, [{"role": "system", "content": "Mine."}, *user])
    assert sorted(b.columns) == ["conv", "who"]


def test_text_parts_and_nested_columns(tokenizer):
    b = PromptBuilder(PromptSpec(messages="body.messages"), tokenizer)
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert b.prompt({"body": {"messages": [{"role": "user", "content": parts}]}}) == expected(tokenizer, [{"role": "user", "content": "a\nb"}])
    assert "body" in b.columns


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "messages column 'm' is null"),
        ("hello", "messages column 'm' is not a list of {role, content} messages (got str)"),
        ([], "messages column 'm' is an empty list"),
        (["hi"], "m[0] is not a {role, content} object (got str)"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], "m[1]: unknown role 'robot'"),
        ([{"content": "b"}], "m[0]: unknown role None"),
        ([{"role": "tool", "content": "42", "tool_call_id": "x"}], "m[0]: tool turns"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}], "m[0]: tool turns"),
        ([{"role": "user", "content": None}], "m[0].content is null"),
        ([{"role": "user", "content": 7}], "m[0].content is not text (got int)"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}], "m[0].content[0] is not a text part (got 'image_url')"),
    ],
)
def test_malformed_messages_are_row_errors_naming_the_column_and_entry(tokenizer, value, message):
    b = PromptBuilder(PromptSpec(messages="m"), tokenizer)
    with pytest.raises(RowError) as e:
        b.encode({"m": value})
    assert message in str(e.value)


def test_missing_column_and_job_errors(tokenizer, tiny_model, tmp_path):
    with pytest.raises(RowError, match="messages column 'm' is missing"):
        PromptBuilder(PromptSpec(messages="m"), tokenizer).encode({"x": 1})
    base = {"model": str(tiny_model), "input": {"path": "in.jsonl", "id_column": "id"}, "output": {"path": "out"}}
    with pytest.raises(JobError, match="give template or messages, not both"):
        load_job({**base, "prompt": {"template": "t", "messages": "m"}}, base_dir=tmp_path)
    with pytest.raises(JobError, match="cannot have chat: false"):
        load_job({**base, "prompt": {"messages": "m", "chat": False}}, base_dir=tmp_path)
    with pytest.raises(JobError, match="missing required key 'prompt.template'"):
        load_job({**base, "prompt": {"system": "s"}}, base_dir=tmp_path)
    no_chat = type("T", (), {"chat_template": None})()
    with pytest.raises(JobError, match="needs a chat template"):
        PromptBuilder(PromptSpec(messages="m"), no_chat)


TURN = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20),
})


@settings(max_examples=60, deadline=None)
@given(turns=st.lists(TURN, min_size=1, max_size=6), system=st.none() | st.just("Job says hi."))
def test_rendering_equals_the_chat_template_of_the_mapped_turns(tokenizer, turns, system):
    b = PromptBuilder(PromptSpec(messages="m", system=system), tokenizer)
    mapped = [{"role": "system" if t["role"] == "developer" else t["role"], "content": t["content"]} for t in turns]
    if system and not any(t["role"] == "system" for t in mapped):
        mapped = [{"role": "system", "content": system}, *mapped]
    assert b.prompt({"m": turns}) == expected(tokenizer, mapped)


def test_messages_job_end_to_end_parquet_and_jsonl(tiny_model, tokenizer, tmp_path):
    """Through the CLI: a Parquet list<struct<role, content>> column and a JSONL file with bad rows."""
    turns = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    convs = [
        [{"role": "user", "content": "invoice total"}],
        [{"role": "system", "content": "Own system."}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
         {"role": "user", "content": "c"}],
        [{"role": "user", "content": None}],  # a null struct field: that row errors
    ]
    data = tmp_path / "data"
    data.mkdir()
    pq.write_table(pa.table({"doc_id": ["p0", "p1", "p2"], "chat": pa.array(convs, turns)}), data / "a.parquet")
    jsonl = [
        {"doc_id": "j0", "chat": [{"role": "user", "content": "date"}]},
        {"doc_id": "j1", "chat": [{"role": "robot", "content": "x"}]},
        {"doc_id": "j2", "chat": "just text"},
        {"doc_id": "j3"},
    ]
    (data / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in jsonl))
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_model), "dtype": "float32"},
        "input": {"path": "data", "id_column": "doc_id"},
        "output": {"path": "out"},
        "prompt": {"messages": "chat", "system": "Job system."},
        "sampling": {"max_tokens": 3},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 64},
    }))
    from typer.testing import CliRunner

    from batchinfer.cli import app

    done = CliRunner().invoke(app, ["run", str(job), "-q", "--log-token-ids", "--max-error-rate", "1"])
    assert done.exit_code == 0, done.output
    df = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("doc_id")
    assert df["doc_id"].to_list() == ["j0", "j1", "j2", "j3", "p0", "p1", "p2"]
    errors = dict(zip(df["doc_id"], df["error"]))
    assert errors["j1"] == "chat[0]: unknown role 'robot' (use system, developer, user or assistant) (b.jsonl line 2)"
    assert errors["j2"] == "messages column 'chat' is not a list of {role, content} messages (got str) (b.jsonl line 3)"
    assert errors["j3"] == "messages column 'chat' is missing (b.jsonl line 4)"
    assert errors["p2"] == "chat[0].content is null (a.parquet line 3)"
    assert all(errors[k] is None for k in ("j0", "p0", "p1"))
    from batchinfer.observe import read_token_ids

    prompts = {r["id"]: tokenizer.decode(r["prompt_token_ids"]) for r in read_token_ids(tmp_path / "out").iter_rows(named=True)}
    assert prompts["p0"] == expected(tokenizer, [{"role": "system", "content": "Job system."}, *convs[0]])
    assert prompts["p1"] == expected(tokenizer, convs[1])  # its own system message: the job's is not added
    assert prompts["j0"] == expected(tokenizer, [{"role": "system", "content": "Job system."}, *jsonl[0]["chat"]])
