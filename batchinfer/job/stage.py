"""Stage 5 with one engine: pending rows -> requests -> engine -> output rows -> part writer; and its setup.

Every executor builds its stages here, the same way: `row_stages` (the request builder and result
converter for one engine), `output_columns` (the output schema, the committed parts' on a resume),
`read_columns` (what the job reads of a row), then runs `execute` over its rows with its own writer.
"""

from __future__ import annotations

import json
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from batchinfer.engine.request import Request
from batchinfer.io import layout
from batchinfer.io.readers import Reject, Row
from batchinfer.io.writer import PartWriter, existing_schema, output_schema
from batchinfer.job.plan import JobPlan, pending_rows
from batchinfer.job.prefetch import Prefetch, PrefetchConfig
from batchinfer.job.prompts import PromptBuilder, RowError
from batchinfer.job.requests import PreparedRow, RequestBuilder, RowMeta, prepare_batch
from batchinfer.job.results import RESULT_NAMES, AnswerGroups, ResultConverter
from batchinfer.job.spec import JobSpec
from batchinfer.job.summary import Progress, RowRecord


class RunError(RuntimeError):
    """The run itself failed (engine crash, disk full, every worker gone): exit code 1."""


def make_engine(spec: JobSpec, on_step: Callable[[Any], None] | None = None, **ready: Any):
    """The default engine factory: batchinfer's Engine for the job's engine config.

    ready: what the engine takes instead of making it (tokenizer, grammar_compiler; or Futures of them)."""
    from batchinfer.engine.engine import Engine

    return Engine(spec.engine_config(), on_step=on_step, **ready)


# ---- setup ---------------------------------------------------------------------------------------


def constraint_of(spec: JobSpec) -> Any:
    """The job's grammar Constraint, or None for a job without `structured`."""
    return spec.structured.constraint() if spec.structured is not None else None


def max_model_len(spec: JobSpec, engine: Any) -> int:
    """The longest prompt + output the engine takes: its own limit, else the job's, else the model's."""
    return getattr(engine, "max_model_len", None) or spec.model.max_model_len or engine.model_info.max_position_embeddings


@dataclass(frozen=True)
class RowStages:
    """Stages 3 and 4 for one engine: rows to requests, results to output rows."""

    builder: RequestBuilder
    converter: ResultConverter

    @property
    def read_columns(self) -> list[str]:
        """The input columns these stages read of a row."""
        return read_columns(self.builder.spec, self.builder.prompts.columns)


def row_stages(spec: JobSpec, engine: Any, tokenizer: Any = None) -> RowStages:
    """The request builder (the engine's length limit; its tokenizer, or `tokenizer`: the same model's,
    loaded by the preflight) and the result converter of a job."""
    constraint = constraint_of(spec)
    tok = tokenizer if tokenizer is not None else engine.tokenizer
    builder = RequestBuilder(spec, tok, max_model_len(spec, engine), constraint)
    return RowStages(builder, ResultConverter(spec, constraint, tok))


def read_columns(spec: JobSpec, template_columns: Iterable[str]) -> list[str]:
    """The input columns a job reads: its id, the kept columns, those its prompt reads, and an OpenAI
    Batch line's method, url and body (read in requests.py)."""
    line = ("method", "url", "body") if spec.input.format == "openai" else ()
    return sorted({spec.input.id_column, *spec.output.keep_columns, *template_columns, *line})


def template_columns(plan: JobPlan) -> list[str]:
    """The row columns the prompt template reads, without an engine (the preflight's tokenizer)."""
    return PromptBuilder(plan.spec.prompt, plan.preflight.tokenizer.result()).columns


def output_columns(plan: JobPlan) -> dict[str, Any]:
    """The output column types (None: inferred from the first part); on a resume, only the committed parts' columns.

    Output written before a column existed keeps its schema: every part of a folder has the same columns.
    """
    converter = ResultConverter(plan.spec, constraint_of(plan.spec))
    columns = output_schema(plan.key_types, converter.columns)
    if plan.manifest.parts:
        names = set(existing_schema(plan.output_dir, plan.manifest.parts[0].name).names)
        columns = {k: v for k, v in columns.items() if k in names or k not in RESULT_NAMES}
    return columns


def start_prompts(plan: JobPlan, prefetch: PrefetchConfig = PrefetchConfig()) -> "Future[Prefetch]":
    """Stage 3 started before the engine is ready: once the preflight's tokenizer is loaded, read the
    pending rows and render and tokenise them ahead (Prefetch, bounded as ever), so the first step
    does not wait for them once the engine is up. `execute(..., ahead=...)` takes it; its rows are what
    the engine's own stage 3 would prepare (prepare_batch needs no engine; the prompt length is checked
    per request, against the engine's limit). Errors come out of `.result()`.

    It starts from the tokenizer Future's callback (on the preflight thread that loaded it), not from a
    thread of its own: `Thread.start()` waits for the new thread to run, and while the tokenizer loads
    it holds the GIL (0.4 s for Qwen's tokenizer.json), which stalled the model load behind it."""
    started: Future = Future()

    def start(tokenizer: Future) -> None:
        try:
            prompts = PromptBuilder(plan.spec.prompt, tokenizer.result())
            rows = pending_rows(plan, read_columns(plan.spec, prompts.columns))
            started.set_result(Prefetch(rows, partial(prepare_batch, prompts), prefetch, name="prompts"))
        except BaseException as e:  # the tokenizer or the plan failed: the run raises it where it takes the rows
            started.set_exception(e)

    plan.preflight.tokenizer.add_done_callback(start)
    return started


# ---- rejects ---------------------------------------------------------------------------------------


def reject_line(r: Reject) -> str:
    """One line of `rejects.jsonl`: the input line that has no usable id, where it is, and why."""
    return json.dumps({"file": r.file, "line": r.line, "text": r.text, "reason": r.reason}, ensure_ascii=False)


@contextmanager
def rejects_file(out: Any) -> Iterator[Any]:
    """The run's `rejects.jsonl` (layout.rejects_path), written aside and put in place, whole, when the
    block ends without error (a failed or stopped run leaves the last complete one; the next run writes
    them all again), on any store."""
    with layout.rejects_path(out).open_atomic_text(tmp_dir=layout.tmp_dir(out)) as f:
        yield f


# ---- execute -----------------------------------------------------------------------------------------


def _one_by_one(items: Iterable[Row | Reject], prepare: Callable[[list[Any]], list[PreparedRow]]) -> Iterator[PreparedRow]:
    """Stage 3 in the engine's thread, one row at a time (execute with prefetch=None)."""
    for item in items:
        yield from prepare([item])


def execute(
    items: Iterable[Row | Reject],
    engine: Any,
    stages: RowStages,
    writer: PartWriter,
    rejects: Any,
    progress: Progress,
    on_row: Callable[[RowRecord], None] | None = None,
    on_progress: Callable[[Progress], None] | None = None,
    should_stop: Callable[[], None] | None = None,
    prefetch: PrefetchConfig | None = PrefetchConfig(),
    ahead: Prefetch | None = None,
) -> None:
    """Feed rows to the engine lazily; write each result as it finishes (rejects to `rejects`, a text file).

    prefetch: render and tokenise rows ahead of the engine on a thread pool, in batches (prefetch.py);
    None: row by row in this thread. Either way the engine gets the same requests in the same order.
    Rows that fail before the engine (template, length) are written straight away, from inside the
    request generator (same thread), so memory stays bounded even for a long run of bad rows.
    ahead: stage 3 already running over `items`' rows (start_prompts), taken instead of starting it here
    (`items` is then not read); closed here either way.
    Raises RunError when the engine ends without a result for every request. should_stop
    (StopRequest.check) is called before each request and after each result; it raises Stopped to
    end the run early (the caller commits what finished).
    """
    if ahead is None and prefetch is not None:
        ahead = Prefetch(items, stages.builder.prepare_batch, prefetch, name="prompts")
    try:
        _execute(ahead if ahead is not None else _one_by_one(items, stages.builder.prepare_batch), engine, stages,
                 writer, rejects, progress, on_row, on_progress, should_stop)
    finally:
        if ahead is not None:
            ahead.close()


def _execute(
    prepared: Iterable[PreparedRow],
    engine: Any,
    stages: RowStages,
    writer: PartWriter,
    rejects: Any,
    progress: Progress,
    on_row: Callable[[RowRecord], None] | None,
    on_progress: Callable[[Progress], None] | None,
    should_stop: Callable[[], None] | None,
) -> None:
    check = should_stop or (lambda: None)
    builder, converter = stages.builder, stages.converter
    key = builder.key_names[0]
    inflight = AnswerGroups()  # a row's answers (sampling.n) come back one by one

    def finish(row: dict[str, Any], record: RowRecord) -> None:
        if on_row:  # before writer.add: a part committed by it then has its rows' records flushed with it
            on_row(record)
        writer.add(row)
        progress.add(record)
        if on_progress:
            on_progress(progress)

    def requests() -> Iterator[Request]:
        n = 0
        for p in prepared:
            check()
            item = p.item
            if isinstance(item, Reject):
                rejects.write(reject_line(item) + "\n")
                progress.rejects += 1
                continue
            meta = builder.meta(item)
            rid = str(n)
            n += 1
            try:
                reqs = builder.requests(p, rid)
            except RowError as e:
                msg = f"{e} ({Path(item.file).name} line {item.line})"
                record = RowRecord(meta.key, "error", 0, 0, error=msg, excerpt=meta.excerpt)
                finish(converter.error_row(meta, msg), record)
                continue
            inflight.open(rid, meta, reqs)
            yield from reqs

    for result in engine.generate(requests()):
        group = inflight.add(result)
        if group is None:
            continue  # more answers of its row to come
        row = converter.row(group.meta, group.results, group.constraint)
        first = group.results[0]
        record = RowRecord(
            group.meta.key, row["finish_reason"], first.prompt_tokens, row["completion_tokens"],
            first.times, first.num_preemptions, row["error"], first, group.meta.excerpt,
        )
        finish(row, record)
        writer.maybe_flush()
        check()
    if inflight:
        raise RunError(f"the engine ended without results for {len(inflight)} row(s)")

