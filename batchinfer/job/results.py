"""Stage 4 of a job: engine Results (or a row error) become an output row; answers are validated.

Columns (see README, "Output"): one row per input id. With `sampling.n` 1 the answer's columns are
the row's (output_text, finish_reason, completion_tokens, error, output, logprob columns). With n > 1
they are fields of the list column `answers` (answer i at index i), and the row keeps what is the
row's: finish_reason (error if any answer failed, else length if any was cut, else stop),
prompt_tokens, completion_tokens (all answers), error (the first failing answer's, prefixed with its
index), timings (first queue wait and first token, longest decode). `AnswerGroups` gathers a row's
answers as they finish, in any order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa

from batchinfer.engine.request import Request, Result
from batchinfer.io.writer import RESULT_FIELDS
from batchinfer.job.spec import JobSpec
from batchinfer.observe import row_metrics
from batchinfer.job.requests import RowMeta

TOP_LOGPROB = pa.struct([("token_id", pa.int32()), ("token", pa.string()), ("logprob", pa.float64())])
LOGPROB_FIELDS = [
    pa.field("token_ids", pa.list_(pa.int32())),  # the answer's tokens (the final EOS / stop token included)
    pa.field("token_logprobs", pa.list_(pa.float64())),  # their logprobs
    pa.field("top_logprobs", pa.list_(pa.list_(TOP_LOGPROB))),  # per token: the K most likely, best first
]
ANSWER_NAMES = ("output_text", "finish_reason", "completion_tokens", "error")  # per answer
# every column stage 4 can write (on a resume, those missing from the committed parts are left out)
RESULT_NAMES = frozenset([f.name for f in RESULT_FIELDS] + [f.name for f in LOGPROB_FIELDS] + ["output", "answers"])


JOB_CONSTRAINT = object()  # ResultConverter.row's default: the row was asked with the job's constraint


# ---- stage 4: results to output rows -----------------------------------------------------------------


@dataclass
class AnswerGroup:
    """One row in flight: its meta, its constraint, and the Results of its answers (None: not yet)."""

    meta: RowMeta
    constraint: Any
    results: list[Result | None]
    missing: int


class AnswerGroups:
    """The rows in flight, by request id: `open` a row's requests, `add` each Result; a row is
    complete (returned by `add`) when all its answers are back."""

    def __init__(self) -> None:
        self._rows: dict[str, AnswerGroup] = {}
        self._owner: dict[str, tuple[str, int]] = {}

    def open(self, row_id: str, meta: RowMeta, requests: list[Request]) -> None:
        self._rows[row_id] = AnswerGroup(meta, requests[0].constraint, [None] * len(requests), len(requests))
        for i, r in enumerate(requests):
            self._owner[r.request_id] = (row_id, i)

    def add(self, result: Result) -> AnswerGroup | None:
        row_id, i = self._owner.pop(result.request_id)
        group = self._rows[row_id]
        group.results[i] = result
        group.missing -= 1
        if group.missing:
            return None
        del self._rows[row_id]
        return group

    def __len__(self) -> int:
        return len(self._rows)


def result_columns(output_type: pa.DataType | None, n: int, logprobs: bool) -> dict[str, pa.DataType]:
    """The columns stage 4 writes, in order (the id and kept columns come first)."""
    answer = [f for f in RESULT_FIELDS if f.name in ANSWER_NAMES]
    if output_type is not None:
        answer.append(pa.field("output", output_type))
    if logprobs:
        answer += LOGPROB_FIELDS
    if n == 1:
        cols = {f.name: f.type for f in RESULT_FIELDS}
        cols.update((f.name, f.type) for f in answer)
        return cols
    cols = {f.name: f.type for f in RESULT_FIELDS if f.name != "output_text"}
    cols["answers"] = pa.list_(pa.struct(answer))
    return cols


class ResultConverter:
    """Stage 4: a row's engine Results (or a row error) become an output row; JSON answers are checked.

    tokenizer: names the top-K alternatives of logprob jobs (their `token` text; None without one).
    """

    def __init__(self, spec: JobSpec, constraint: Any, tokenizer: Any = None) -> None:
        self.constraint = constraint
        self.schema = spec.structured.schema_dict() if spec.structured and spec.structured.json_schema is not None else None
        self.output_type: pa.DataType | None = None
        self._to_arrow: Callable[[Any], Any] | None = None
        if self.schema is not None:
            self.output_type, self._to_arrow = _arrow_mapping(self.schema)
        self.n = spec.sampling.n
        self.logprobs = spec.sampling.logprobs is not None
        self.columns = result_columns(self.output_type, self.n, self.logprobs)
        self.piece = TokenTexts(tokenizer)  # token id -> text, for the top_logprobs structs

    def _blank_answer(self) -> dict[str, Any]:
        a: dict[str, Any] = {}
        if self.schema is not None:
            a["output"] = None
        if self.logprobs:
            a.update((f.name, None) for f in LOGPROB_FIELDS)
        return a

    def error_row(self, meta: RowMeta, message: str) -> dict[str, Any]:
        """A row that never reached the engine (its answers are null)."""
        row = dict(meta.keys)
        row.update(finish_reason="error", prompt_tokens=meta.prompt_tokens, completion_tokens=0, error=message)
        row.update(row_metrics(None))  # never reached the engine: no timings
        if self.n == 1:
            row.update(output_text=None, **self._blank_answer())
        else:
            row["answers"] = None
        return row

    def row(self, meta: RowMeta, results: "list[Result] | Result", constraint: Any = JOB_CONSTRAINT) -> dict[str, Any]:
        """The output row of a row's answers. constraint: the row's requests' (None: unconstrained;
        default: the job's). A row's own constraint (an OpenAI line's response_format) is validated,
        but its answer is not put in the typed `output` column, which has the job schema's type."""
        results = [results] if isinstance(results, Result) else results
        constraint = self.constraint if constraint is JOB_CONSTRAINT else constraint
        typed = constraint is self.constraint
        answers = [self._answer(meta, r, constraint, typed) for r in results]
        out = dict(meta.keys)
        first = results[0]
        if self.n == 1:
            out.update(answers[0])
            out["prompt_tokens"] = first.prompt_tokens
            out.update(row_metrics(first))  # queue_wait_s, ttft_s, decode_s
            return out
        failed = [(i, a) for i, a in enumerate(answers) if a["error"] is not None]
        reasons = {a["finish_reason"] for a in answers}
        out.update(
            finish_reason="error" if "error" in reasons else "length" if "length" in reasons else "stop",
            prompt_tokens=first.prompt_tokens,
            completion_tokens=sum(a["completion_tokens"] for a in answers),
            error=f"answer {failed[0][0]}: {failed[0][1]['error']}" if failed else None,
        )
        out.update(_merged_metrics([row_metrics(r) for r in results]))
        out["answers"] = answers
        return out

    def _answer(self, meta: RowMeta, result: Result, constraint: Any, typed: bool) -> dict[str, Any]:
        """One answer's columns: text, finish reason, tokens, error; output and logprobs when the job has them."""
        a = self._blank_answer()
        a.update(
            output_text=result.text if result.finish_reason != "error" else (result.text or None),
            finish_reason=result.finish_reason,
            completion_tokens=result.completion_tokens,
            error=result.error,
        )
        if result.finish_reason == "error":
            a["error"] = f"{a['error'] or 'the engine failed this row without a message'} ({Path(meta.file).name} line {meta.line})"
        elif constraint is not None:
            value, err = _validate(constraint, result.text)
            if err is not None:
                if result.finish_reason == "length":
                    a["error"] = f"output cut at max_tokens ({result.completion_tokens} tokens) before it matched: {err}"
                else:
                    a["finish_reason"] = "error"
                    a["error"] = f"output does not match the constraint: {err}"
            elif self.schema is not None and typed:
                a["output"] = self._to_arrow(value)  # type: ignore[misc]
        if self.logprobs and result.logprobs is not None:
            a["token_ids"] = [t.token_id for t in result.logprobs]
            a["token_logprobs"] = [t.logprob for t in result.logprobs]
            a["top_logprobs"] = [
                [{"token_id": i, "token": self.piece(i), "logprob": lp} for i, lp in t.top] for t in result.logprobs
            ]
        return a



class TokenTexts:
    """token id -> the token's text (special tokens by name), cached; None without a tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def _merged_metrics(each: list[dict[str, Any]]) -> dict[str, Any]:
    """A row's timings over its answers: the first queue wait and first token, the longest decode."""
    def pick(name: str, fn: Callable[..., Any]) -> Any:
        values = [m[name] for m in each if m.get(name) is not None]
        return fn(values) if values else None

    return {"queue_wait_s": pick("queue_wait_s", min), "ttft_s": pick("ttft_s", min), "decode_s": pick("decode_s", max)}


def _arrow_mapping(schema: dict[str, Any]) -> tuple[pa.DataType, Callable[[Any], Any]]:
    """The `output` column type for a JSON schema (an Arrow struct etc.), or JSON text where none fits."""
    from batchinfer.structured.arrow import arrow_type_for_schema, to_arrow_value

    typ = arrow_type_for_schema(schema)
    return (typ if typ is not None else pa.string()), (lambda v: to_arrow_value(v, schema))


def _validate(constraint: Any, text: str) -> tuple[Any, str | None]:
    from batchinfer.structured.validate import validate_output

    return validate_output(constraint, text)
