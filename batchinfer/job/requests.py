"""Stage 3 of a job: a row becomes engine Requests (prompt rendered and tokenised), or a RowError.

A row with n answers (`sampling.n`, or an OpenAI line's body.n) becomes n requests of one prompt,
ids `<rid>.<i>`, answer i drawing with seed + i (so the answers differ and each is reproducible;
answer 0 is the answer an n = 1 job gives). The engine's prefix sharing computes their prompt once.

Split in two so that the heavy half can run ahead of the engine on other threads (prefetch.py):
`prepare_batch` renders a batch of rows and tokenises them with one tokenizer call (a fast tokenizer
releases the GIL); `requests` turns one prepared row into its Requests (the OpenAI line's sampling,
the length check, the request ids) on the engine's side. `build` is both halves for one row.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from batchinfer.engine.request import Request, SamplingParams
from batchinfer.io.readers import Reject, Row
from batchinfer.io.resume import HASH_COLUMN, row_hash
from batchinfer.job.spec import JobSpec
from batchinfer.job.prompts import PromptBuilder, RowError

EXCERPT_CHARS = 200


# ---- stage 3: rows to requests -----------------------------------------------------------------------


@dataclass(frozen=True)
class RowMeta:
    """What the writer needs of a row once its result comes back (not the row's text)."""

    keys: dict[str, Any]
    file: str
    line: int
    prompt_tokens: int = 0
    excerpt: str | None = None  # the start of the row's template columns, for the run report
    key: str = ""  # the id's canonical key (io/id_key.py): what run records and resume compare


def answer_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Answer `index` of a row: seed + index (no seed: the engine draws one per answer)."""
    if index == 0 or sampling.seed is None:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + index)


@dataclass(frozen=True)
class PreparedRow:
    """An input item after `prepare_batch`: a Reject as it was, or a row with its prompt (text and
    token ids) or the RowError its prompt raised."""

    item: Row | Reject
    text: str | None = None
    ids: list[int] | None = None
    error: RowError | None = None


def prepare_batch(prompts: PromptBuilder, items: list[Row | Reject]) -> list[PreparedRow]:
    """Render and tokenise the rows of a batch (one tokenizer call); rejects pass through. Needs no
    engine: stage 3 can start while the engine loads (stage.start_prompts)."""
    rows = [i for i in items if isinstance(i, Row)]
    encoded = iter(prompts.encode_many([r.values for r in rows]))
    out = []
    for item in items:
        if isinstance(item, Reject):
            out.append(PreparedRow(item))
            continue
        got = next(encoded)
        out.append(PreparedRow(item, error=got) if isinstance(got, RowError) else PreparedRow(item, got[0], got[1]))
    return out


class RequestBuilder:
    """Stage 3: a row becomes its Requests (or a RowError naming what is wrong with it)."""

    def __init__(self, spec: JobSpec, tokenizer: Any, max_model_len: int, constraint: Any) -> None:
        self.spec = spec
        self.prompts = PromptBuilder(spec.prompt, tokenizer)
        self.max_model_len = max_model_len
        self.sampling = spec.sampling.to_params()
        self.n = spec.sampling.n
        self.constraint = constraint
        self.openai = spec.input.format == "openai"
        self.whitespace = spec.structured.whitespace if spec.structured is not None else "compact"
        self.key_names = [spec.input.id_column] + [c for c in spec.output.keep_columns if c != spec.input.id_column]

    def keys(self, row: Row) -> dict[str, Any]:
        out = {k: row.values.get(k) for k in self.key_names}
        if self.spec.input.check_content:
            out[HASH_COLUMN] = row_hash(row.values)
        return out

    def meta(self, row: Row) -> RowMeta:
        """What the writer and the run records keep of a row while it is in the engine."""
        return RowMeta(self.keys(row), row.file, row.line, excerpt=input_excerpt(row.values, self.prompts.columns),
                       key=row.id_key(self.key_names[0]))

    def prepare_batch(self, items: list[Row | Reject]) -> list[PreparedRow]:
        """Render and tokenise the rows of a batch (one tokenizer call); rejects pass through."""
        return prepare_batch(self.prompts, items)

    def build(self, row: Row, request_id: str) -> list[Request]:
        """The row's requests: both halves for one row (the serial path)."""
        return self.requests(self.prepare_batch([row])[0], request_id)

    def requests(self, prepared: PreparedRow, request_id: str) -> list[Request]:
        """A prepared row's requests: one per answer (all with one constraint; see the module docstring);
        RowError for its prompt's error, a bad OpenAI line or a prompt too long."""
        row = prepared.item
        assert isinstance(row, Row), "a Reject has no requests"
        sampling, constraint, n = self.sampling, self.constraint, self.n
        if self.openai:
            from batchinfer.io.openai_batch import line_request

            line = line_request(row.values, sampling, n, sampling.logprobs, constraint, self.whitespace)
            sampling, constraint, n = line.sampling, line.constraint, line.n
        if prepared.error is not None:
            raise prepared.error
        text, ids = prepared.text or "", prepared.ids or []
        if len(ids) >= self.max_model_len:
            limit = self.max_model_len
            raise RowError(f"prompt has {len(ids)} tokens; the model allows at most {limit - 1} (max_model_len {limit})")
        if n == 1:
            return [Request(request_id, ids, sampling, constraint, text)]
        return [Request(f"{request_id}.{i}", ids, answer_sampling(sampling, i), constraint, text) for i in range(n)]


_WORD = re.compile(r"\S+")


def _head(text: str, limit: int) -> str:
    """The first words of text, whitespace collapsed, until there are more than `limit` characters
    (reads only as far as that)."""
    words, n = [], 0
    for m in _WORD.finditer(text):
        words.append(m.group())
        n += len(words[-1]) + (len(words) > 1)  # the joined length (a space between words)
        if n > limit:
            break
    return " ".join(words)


def _text_of(value: Any) -> str:
    """What a person reads of a column value: text as it is; of chat messages (or an OpenAI body
    holding them) the last user message's content."""
    if isinstance(value, dict) and isinstance(value.get("messages"), list):
        value = value["messages"]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        users = [m for m in value if m.get("role") == "user"] or value
        return str(users[-1].get("content", ""))
    return str(value)


def input_excerpt(values: dict[str, Any], columns: list[str], limit: int = EXCERPT_CHARS) -> str | None:
    """The start of a row's prompt columns on one line ("col: text | col2: text" for several), at most
    `limit` characters; None when the row has none of them. Cheap: only each value's head is read."""
    present = [(c, values[c]) for c in columns if values.get(c) is not None]
    if not present:
        return None
    parts = []
    for name, value in present:
        head = _head(_text_of(value), limit)
        parts.append(head if len(present) == 1 else f"{name}: {head}")
    text = " | ".join(parts)
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "\u2026"
