"""OpenAI Batch files in (input.format openai) and out (output.format openai: results.jsonl, errors.jsonl)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from batchinfer.engine.request import SamplingParams
from batchinfer.io import layout
from batchinfer.io.openai_batch import line_request
from batchinfer.job.prompts import RowError
from batchinfer.structured.base import Constraint

URL = "/v1/chat/completions"
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["yes", "no"]}}, "required": ["k"], "additionalProperties": False}
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def line(cid, body, **kw) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": URL, "body": body, **kw})


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---- one line --------------------------------------------------------------------------------------


JOB = SamplingParams(max_tokens=16, temperature=0.0, seed=0)


def test_line_fields_override_the_job_and_the_rest_is_the_jobs():
    r = line_request({"url": URL, "body": {"messages": [], "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0.5,
                                            "top_p": 0.9, "seed": 3, "stop": "END", "model": "gpt-4o", "user": "u"}}, JOB, 1, None, None)
    assert (r.sampling.max_tokens, r.sampling.temperature, r.sampling.top_p, r.sampling.seed, r.sampling.stop) == (7, 0.5, 0.9, 3, ("END",))
    assert r.constraint is None and not r.own_constraint and r.n == 1
    same = line_request({"url": URL, "body": {"messages": []}}, JOB, 1, None, Constraint.regex("a+"))
    assert same.sampling == JOB and same.constraint == Constraint.regex("a+") and not same.own_constraint
    lists = line_request({"url": URL, "body": {"messages": [], "stop": ["a", "b"], "top_k": 4, "min_tokens": 2}}, JOB, 1, None, None)
    assert lists.sampling.stop == ("a", "b") and lists.sampling.top_k == 4 and lists.sampling.min_tokens == 2


def test_response_format_is_the_lines_constraint():
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}}
    r = line_request({"url": URL, "body": {"messages": [], "response_format": fmt}}, JOB, 1, None, Constraint.regex("a"))
    assert r.constraint == Constraint.json_schema(SCHEMA) and r.own_constraint
    obj = line_request({"url": URL, "body": {"messages": [], "response_format": {"type": "json_object"}}}, JOB, 1, None, None)
    assert obj.constraint == Constraint.json_schema({"type": "object"})
    text = line_request({"url": URL, "body": {"messages": [], "response_format": {"type": "text"}}}, JOB, 1, None, Constraint.regex("a"))
    assert text.constraint is None and text.own_constraint


def test_n_and_logprobs_of_a_line():
    assert line_request({"url": URL, "body": {"messages": [], "n": 3}}, JOB, 2, None, None).n == 3
    assert line_request({"url": URL, "body": {"messages": [], "logprobs": True, "top_logprobs": 4}}, JOB, 1, 2, None).sampling.logprobs == 4
    assert line_request({"url": URL, "body": {"messages": [], "logprobs": True}}, JOB, 1, 2, None).sampling.logprobs == 0
    assert line_request({"url": URL, "body": {"messages": [], "logprobs": False}}, JOB, 1, 2, None).sampling.logprobs is None
    assert line_request({"url": URL, "body": {"messages": []}}, JOB, 1, 2, None).sampling.logprobs == 2


@pytest.mark.parametrize(
    "obj, message",
    [
        ({"url": "/v1/embeddings", "body": {}}, "url '/v1/embeddings' is not supported (only /v1/chat/completions)"),
        ({"body": {}}, "url is missing"),
        ({"method": "GET", "url": URL, "body": {}}, "method 'GET'"),
        ({"url": URL}, "body is missing"),
        ({"url": URL, "body": [1]}, "body is not an object (got list)"),
        ({"url": URL, "body": {"messages": [], "tools": [{"type": "function"}]}}, "body.tools is not supported"),
        ({"url": URL, "body": {"messages": [], "frequency_penalty": 0.5}}, "body.frequency_penalty is not supported"),
        ({"url": URL, "body": {"messages": [], "reasoning_effort": "high"}}, "body.reasoning_effort is not supported"),
        ({"url": URL, "body": {"messages": [], "max_tokens": 0}}, "body.max_tokens must be an integer >= 1"),
        ({"url": URL, "body": {"messages": [], "temperature": "hot"}}, "body.temperature must be a number"),
        ({"url": URL, "body": {"messages": [], "top_p": 0}}, "body: top_p must be in (0, 1]"),
        ({"url": URL, "body": {"messages": [], "stop": [1]}}, "body.stop must be a string or a list of strings"),
        ({"url": URL, "body": {"messages": [], "n": 2}}, "set sampling.n above 1"),
        ({"url": URL, "body": {"messages": [], "logprobs": True}}, "set sampling.logprobs in the job"),
        ({"url": URL, "body": {"messages": [], "top_logprobs": 2}}, "body.top_logprobs needs body.logprobs: true"),
        ({"url": URL, "body": {"messages": [], "response_format": {"type": "xml"}}}, "body.response_format.type 'xml' is not supported"),
        ({"url": URL, "body": {"messages": [], "response_format": {"type": "json_schema", "json_schema": {}}}}, "json_schema.schema is missing"),
    ],
)
def test_lines_the_job_cannot_serve_are_row_errors_naming_the_field(obj, message):
    with pytest.raises(RowError) as e:
        line_request(obj, JOB, 1, None, None)
    assert message in str(e.value)


# ---- whole files through the CLI ---------------------------------------------------------------------


def write_job(tmp: Path, model: Path, **sampling) -> Path:
    job = tmp / "job.yaml"
    job.write_text(yaml.safe_dump({
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": "batch.jsonl", "format": "openai"},
        "output": {"path": "out", "format": "openai", "rows_per_part": 2, "seconds_per_part": 0.3},
        "sampling": {"max_tokens": 6, **sampling},
        "engine": {"max_num_seqs": 2, "device": "cpu", "num_kv_blocks": 64},
    }))
    return job


def cli(job: Path, *args: str):
    """`batchinfer run JOB -q ARGS` in this process (the kill test starts a real one)."""
    from typer.testing import CliRunner

    from batchinfer.cli import app

    return CliRunner().invoke(app, ["run", str(job), "-q", *args])


def read_jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def check_result_shape(r: dict, model: Path) -> None:
    assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None and r["id"].startswith("batch_req_")
    resp = r["response"]
    assert resp["status_code"] == 200 and resp["request_id"].startswith("req_")
    body = resp["body"]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    assert body["model"] == model.name  # the model that answered (the job's), not the line's body.model
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and u["prompt_tokens"] > 0


def test_openai_batch_file_end_to_end_with_bad_lines(tiny_model, tmp_path):
    lines = [
        line("a", {"model": "gpt-4o-mini", "messages": user("hello there"), "max_tokens": 5}),
        line("b", {"messages": [{"role": "system", "content": "Short."}, *user("hi"), {"role": "assistant", "content": "yo"},
                                *user("again")], "max_completion_tokens": 3, "temperature": 0.7, "seed": 3}),
        line("c", {"messages": user("json"), "max_tokens": 30,
                   "response_format": {"type": "json_schema", "json_schema": {"name": "k", "schema": SCHEMA}}}),
        "this is not JSON",
        json.dumps({"method": "POST", "url": URL, "body": {"messages": user("no id")}}),
        line("a", {"messages": user("the same id again")}),
        line("d", {"messages": [{"role": "robot", "content": "x"}]}),
        line("e", {"max_tokens": 3}),
        line("f", {"messages": user("x")}, url="/v1/embeddings"),
    ]
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    done = cli(write_job(tmp_path, tiny_model), "--max-error-rate", "1")
    assert done.exit_code == 0, done.output
    out = tmp_path / "out"
    rejects = {r["line"]: r for r in read_jsonl(layout.rejects_path(out))}
    assert sorted(rejects) == [4, 5, 6] and all(r["file"].endswith("batch.jsonl") for r in rejects.values())
    assert rejects[4]["reason"].startswith("not valid JSON")
    assert rejects[5]["reason"] == "id column 'custom_id' is missing"
    assert rejects[6]["reason"] == "duplicate custom_id 'a' (first at batch.jsonl line 1, which is the one answered)"
    results = {r["custom_id"]: r for r in read_jsonl(layout.openai_paths(out)[0])}
    errors = {r["custom_id"]: r for r in read_jsonl(layout.openai_paths(out)[1])}
    assert not set(results) & set(errors) and set(results) | set(errors) == set("abcdef")  # every custom_id once
    assert {"a", "b"} <= set(results)
    for r in results.values():
        check_result_shape(r, tiny_model)
    assert results["a"]["response"]["body"]["usage"]["completion_tokens"] <= 5
    assert results["b"]["response"]["body"]["usage"]["completion_tokens"] <= 3  # max_completion_tokens of the line
    if "c" in results:  # its own schema: a success is valid JSON of it
        jsonschema.validate(json.loads(results["c"]["response"]["body"]["choices"][0]["message"]["content"]), SCHEMA)
    else:
        assert errors["c"]["error"]["code"] == "invalid_output"
    for cid, text in [("d", "body.messages[0]: unknown role 'robot'"), ("e", "messages column 'body.messages' is missing"),
                      ("f", "url '/v1/embeddings' is not supported")]:
        e = errors[cid]
        assert e["error"]["code"] == "invalid_request" and e["response"]["status_code"] == 400
        assert e["error"]["message"].startswith(text) and e["error"]["message"].endswith(f"(batch.jsonl line {'def'.index(cid) + 7})")
        assert e["response"]["body"]["error"]["message"] == e["error"]["message"]


def committed_parts(out: Path) -> int:
    try:
        return len(json.loads(layout.manifest_path(out).read_text())["parts"])
    except (OSError, ValueError, KeyError):
        return 0


def test_kill_and_resume_every_custom_id_once_across_results_and_errors(tiny_model, tmp_path):
    ids = [f"r{i:02d}" for i in range(14)]
    lines = [line(c, {"messages": user(f"doc {i} total {i * 7}"), "max_tokens": 2 + i % 3}) for i, c in enumerate(ids)]
    lines[5] = line("r05", {"messages": [{"role": "robot", "content": "x"}]})  # an error row
    (tmp_path / "batch.jsonl").write_text("\n".join(lines) + "\n")
    job = write_job(tmp_path, tiny_model)
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, "-m", "batchinfer.cli", "run", str(job), "-q"], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while committed_parts(out) < 1 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, f"the run ended before the kill:\n{p.communicate()[0]}"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert 1 <= committed_parts(out) and not layout.openai_paths(out)[0].exists()
    done = cli(job)
    assert done.exit_code == 3, done.output  # r05 is an error row: over --max-error-rate 0
    results, errors = read_jsonl(layout.openai_paths(out)[0]), read_jsonl(layout.openai_paths(out)[1])
    got = [r["custom_id"] for r in results + errors]
    assert sorted(got) == ids  # every custom_id exactly once across the two files
    assert [e["custom_id"] for e in errors] == ["r05"]
    for r in results:
        check_result_shape(r, tiny_model)
    # a run with nothing to do rewrites a missing file, byte for byte the same
    before = layout.openai_paths(out)[0].read_bytes(), layout.openai_paths(out)[1].read_bytes()
    layout.openai_paths(out)[1].delete()
    from batchinfer.job import run_job as run

    assert run(job).nothing_to_do
    assert (layout.openai_paths(out)[0].read_bytes(), layout.openai_paths(out)[1].read_bytes()) == before


def test_a_line_without_a_constraint_is_not_checked_against_the_jobs(tiny_model, tmp_path):
    """response_format text on a job with `structured`: that line was unconstrained, and is not validated."""
    from batchinfer.engine.request import Result
    from batchinfer.job.spec import load_job
    from batchinfer.job.requests import RowMeta
    from batchinfer.job.results import ResultConverter

    spec = load_job({"model": str(tiny_model), "input": {"path": "b.jsonl", "format": "openai"}, "output": {"path": "out"},
                     "structured": {"choice": ["yes", "no"]}}, base_dir=tmp_path)
    converter = ResultConverter(spec, spec.structured.constraint())
    result = Result("0", [1, 2], [7], "free text", "stop", 2, 1)
    meta = RowMeta({"custom_id": "x"}, "b.jsonl", 1)
    assert converter.row(meta, [result], None)["error"] is None
    assert "not one of the 2 choices" in converter.row(meta, [result])["error"]
