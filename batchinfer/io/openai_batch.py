"""The OpenAI Batch format, in and out.

In (`input.format: openai`): a JSONL file, one request per line:
    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 64, "temperature": 0.2, ...}}
custom_id is the row's id and body.messages its chat (prompts.py renders it). `line_request` reads
the rest of a line: the sampling fields override the job's `sampling` for that line (what a line
leaves out, the job gives), and `response_format` (json_schema, json_object) is the line's
constraint. A line the job cannot serve as asked (another url, tools, penalties, an unknown body
key) is a row error naming the field, never silently answered differently.

Out (`output.format: openai`): after a run, `results.jsonl` (the answered lines) and `errors.jsonl`
(the lines whose row has an error), written from the committed Parquet parts, so every committed id
is in exactly one of the two, once, after any kill and resume. They are rewritten (temp names, then
renamed) at the end of every run that changed the output, and by a run with nothing to do when they
are missing or do not hold every committed row (a kill while they were written). `id`, `request_id` and the completion's `id` are derived
from the job fingerprint and the custom_id, and `created` is the part file's time, so rewriting
gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from batchinfer.engine.request import MAX_LOGPROBS, SamplingParams
from batchinfer.io.layout import OPENAI_ERRORS, OPENAI_RESULTS, openai_paths
from batchinfer.job.prompts import RowError
from batchinfer.structured.base import Constraint

URL = "/v1/chat/completions"
RESULTS, ERRORS = OPENAI_RESULTS, OPENAI_ERRORS

# body keys taken as they are in SamplingParams (the OpenAI names, and the extensions vLLM's batch runner reads)
_NUMBERS = {"temperature": float, "top_p": float, "min_p": float, "top_k": int, "min_tokens": int, "seed": int}
_FLAGS = ("ignore_eos", "skip_special_tokens")
# body keys that do not change an answer here
_IGNORED = frozenset({
    "model", "user", "metadata", "store", "service_tier", "stream", "stream_options", "parallel_tool_calls",
    "prompt_cache_key", "safety_identifier",
})
# body keys allowed only at their "off" value
_OFF = {"frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
        "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"), "function_call": (None, "none", "auto")}
_KNOWN = frozenset({"messages", "max_tokens", "max_completion_tokens", "stop", "stop_token_ids", "n", "logprobs",
                    "top_logprobs", "response_format", *_NUMBERS, *_FLAGS, *_IGNORED, *_OFF})


@dataclass(frozen=True)
class LineRequest:
    """What one OpenAI Batch line asks for: sampling, constraint (own: from its response_format) and answers."""

    sampling: SamplingParams
    constraint: Constraint | None
    own_constraint: bool
    n: int


def _int(body: dict[str, Any], key: str, low: int) -> int:
    v = body[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise RowError(f"body.{key} must be an integer >= {low} (got {v!r})")
    return v


def _constraint(fmt: Any, whitespace: str) -> Constraint | None:
    """The constraint of a response_format (None: plain text)."""
    if not isinstance(fmt, dict):
        raise RowError(f"body.response_format must be an object (got {type(fmt).__name__})")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_schema({"type": "object"}, whitespace=whitespace)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RowError("body.response_format.json_schema.schema is missing (a JSON Schema object)")
        return Constraint.json_schema(schema, whitespace=whitespace)
    raise RowError(f"body.response_format.type {kind!r} is not supported (use text, json_object or json_schema)")


def line_request(
    line: dict[str, Any],
    sampling: SamplingParams,
    n: int,
    logprobs: int | None,
    constraint: Constraint | None,
    whitespace: str = "compact",
) -> LineRequest:
    """Read one parsed OpenAI Batch line against the job's defaults (sampling, n, logprobs K, constraint).

    Raises RowError naming the field: a method other than POST, a url other than /v1/chat/completions,
    no body, a field of the wrong type, a feature not served here (tools, penalties, another
    response_format), an unknown key; more answers (n) or logprobs than the job's output columns hold.
    The messages themselves are checked where they are rendered (prompts.chat_messages).
    """
    method = line.get("method", "POST")
    if method != "POST":
        raise RowError(f"method {method!r}: an OpenAI Batch line is a POST to {URL}")
    url = line.get("url")
    if url != URL:
        raise RowError(f"url is missing; use {URL}" if url is None else f"url {url!r} is not supported (only {URL})")
    body = line.get("body")
    if not isinstance(body, dict):
        raise RowError("body is missing" if body is None else f"body is not an object (got {type(body).__name__})")
    unknown = sorted(k for k in body if k not in _KNOWN)
    if unknown:
        raise RowError(f"body.{unknown[0]} is not supported")
    for key, off in _OFF.items():
        if key in body and body[key] not in off:
            raise RowError(f"body.{key} is not supported (only {off[1]!r})")
    over: dict[str, Any] = {}
    for key in ("max_tokens", "max_completion_tokens"):  # the newer name wins
        if body.get(key) is not None:
            over["max_tokens"] = _int(body, key, 1)
    for key, kind in _NUMBERS.items():
        v = body.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
            raise RowError(f"body.{key} must be a number (got {v!r})" if kind is float else f"body.{key} must be an integer (got {v!r})")
        over[key] = kind(v)
    for key in _FLAGS:
        if body.get(key) is not None:
            if not isinstance(body[key], bool):
                raise RowError(f"body.{key} must be true or false (got {body[key]!r})")
            over[key] = body[key]
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise RowError(f"body.stop must be a string or a list of strings (got {stop!r})")
        over["stop"] = tuple(stops)
    if body.get("stop_token_ids") is not None:
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise RowError(f"body.stop_token_ids must be a list of integers (got {ids!r})")
        over["stop_token_ids"] = tuple(ids)
    over["logprobs"] = _logprobs(body, logprobs)
    answers = n
    if body.get("n") is not None:
        answers = _int(body, "n", 1)
        if answers > 1 and n == 1:
            raise RowError(f"body.n is {answers}: set sampling.n above 1 in the job for more than one answer per line")
        if answers > 128:
            raise RowError(f"body.n is {answers}: at most 128")
    own = body.get("response_format") is not None
    if own:
        constraint = _constraint(body["response_format"], whitespace)
    try:
        params = dataclasses.replace(sampling, **over)
    except ValueError as e:
        raise RowError(f"body: {e}") from None
    return LineRequest(params, constraint, own, answers)


def _logprobs(body: dict[str, Any], job: int | None) -> int | None:
    """The line's K (body.logprobs, body.top_logprobs), the job's when it says nothing."""
    asked = body.get("logprobs")
    top = body.get("top_logprobs")
    if asked is None and top is None:
        return job
    if asked is not None and not isinstance(asked, bool):
        raise RowError(f"body.logprobs must be true or false (got {asked!r})")
    if top is not None and not asked:
        raise RowError("body.top_logprobs needs body.logprobs: true")
    if not asked:
        return None
    if job is None:
        raise RowError("body.logprobs: set sampling.logprobs in the job for logprobs (the output's logprob columns)")
    if top is None:
        return 0
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS:
        raise RowError(f"body.top_logprobs must be an integer in [0, {MAX_LOGPROBS}] (got {top!r})")
    return top


# ---- out: results.jsonl / errors.jsonl ------------------------------------------------------------


def up_to_date(out: Any, rows: int) -> bool:
    """Whether both files exist and hold `rows` lines together (the committed rows). Parts only ever
    gain rows, so a pair written for fewer rows (a kill between the two writes) shows in the count."""
    paths = openai_paths(out)
    if not all(p.exists() for p in paths):
        return False
    return sum(p.count_lines() for p in paths) == rows


def _ids(fingerprint: str, custom_id: str) -> tuple[str, str, str]:
    h = hashlib.sha256(f"{fingerprint}\0{custom_id}".encode()).hexdigest()
    return f"batch_req_{h[:32]}", f"req_{h[32:64]}", f"chatcmpl-{h[:24]}"


def _logprobs_content(answer: dict[str, Any], piece: Callable[[int], str | None]) -> dict[str, Any] | None:
    ids = answer.get("token_ids")
    if ids is None:
        return None
    content = []
    for tid, lp, top in zip(ids, answer["token_logprobs"], answer["top_logprobs"]):
        alts = [{"token": t["token"], "logprob": t["logprob"], "bytes": None} for t in top]
        content.append({"token": piece(tid), "logprob": lp, "bytes": None, "top_logprobs": alts})
    return {"content": content, "refusal": None}


def _choices(row: dict[str, Any], piece: Callable[[int], str | None]) -> list[dict[str, Any]]:
    answers = row["answers"] if "answers" in row else [row]
    return [
        {
            "index": i,
            "message": {"role": "assistant", "content": a["output_text"], "refusal": None},
            "logprobs": _logprobs_content(a, piece),
            "finish_reason": a["finish_reason"],
        }
        for i, a in enumerate(answers or [])
    ]


def output_lines(
    row: dict[str, Any], id_column: str, fingerprint: str, model: str, created: int, piece: Callable[[int], str | None]
) -> tuple[bool, str]:
    """(ok, JSON line) of one output row: a chat completion, or an error (400: the request was not
    served, e.g. a bad line or a prompt too long; 500: the answer failed, e.g. its schema)."""
    custom_id = str(row[id_column])
    batch_id, request_id, completion_id = _ids(fingerprint, custom_id)
    prompt, completion = int(row["prompt_tokens"] or 0), int(row["completion_tokens"] or 0)
    if row["error"] is None:
        body = {
            "id": completion_id, "object": "chat.completion", "created": created, "model": model,
            "choices": _choices(row, piece),
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
        }
        line = {"id": batch_id, "custom_id": custom_id, "response": {"status_code": 200, "request_id": request_id, "body": body},
                "error": None}
        return True, json.dumps(line, ensure_ascii=False)
    served = completion > 0
    code = "invalid_output" if served else "invalid_request"
    error = {"message": row["error"], "type": "server_error" if served else "invalid_request_error", "param": None, "code": code}
    line = {"id": batch_id, "custom_id": custom_id,
            "response": {"status_code": 500 if served else 400, "request_id": request_id, "body": {"error": error}},
            "error": {"code": code, "message": row["error"]}}
    return False, json.dumps(line, ensure_ascii=False)


def _rows(path: Any, columns: list[str]) -> Iterator[dict[str, Any]]:
    import pyarrow.parquet as pq

    with path.open_input_file() as fh:
        pf = pq.ParquetFile(fh)
        names = [c for c in columns if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(batch_size=1024, columns=names):
            yield from batch.to_pylist()


def write_output_files(
    out: Any, parts: list[Any], id_column: str, fingerprint: str, model: str, piece: Callable[[int], str | None]
) -> tuple[int, int]:
    """Write results.jsonl and errors.jsonl (io/layout.py: beside the output, with the run records) of
    the output folder `out` from its committed `parts` (Locations, in order): each file appears whole
    (store.py); a kill between the two leaves a pair whose line count shows it (up_to_date); returns the counts."""
    from batchinfer.io import layout

    columns = [id_column, "output_text", "finish_reason", "prompt_tokens", "completion_tokens", "error",
               "token_ids", "token_logprobs", "top_logprobs", "answers"]
    final = openai_paths(out)
    tmp = layout.tmp_dir(out)
    counts = [0, 0]
    with final[0].open_atomic_text(tmp) as ok_file, final[1].open_atomic_text(tmp) as err_file:
        for part in parts:
            created = int(part.mtime())
            for row in _rows(part, columns):
                ok, line = output_lines(row, id_column, fingerprint, model, created, piece)
                (ok_file if ok else err_file).write(line + "\n")
                counts[0 if ok else 1] += 1
    return counts[0], counts[1]
