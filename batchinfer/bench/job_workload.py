"""A benchmark workload made from a job file: its input rows, prompts, sampling and constraint.

`bench throughput --workload jobs/quickstart.yaml --model PATH` runs the requests `batchinfer run`
would send to the engine for that job (the job's prompt template and the model's chat template, its
sampling, its JSON schema), against the engine alone. With a real model this is the workload that
measures what speculative decoding gets on real text: the quickstart job extracts five fields as
JSON from 24 real-looking invoices, receipts and emails (examples/data/invoices.jsonl), so answers
copy spans of their document and the schema forces its keys and punctuation.

Rows whose prompt fails (a missing column, a prompt too long) are left out, and counted.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from batchinfer.bench.workloads import Workload

JOB_SUFFIXES = (".yaml", ".yml")


def is_job_file(name: str) -> bool:
    """Whether a --workload value names a job file rather than a built-in workload."""
    return name.endswith(JOB_SUFFIXES)


def job_workload(path: str | Path, tokenizer: Any, max_model_len: int, max_tokens: int | None = None,
                 limit: int | None = None) -> Workload:
    """The job's requests (first `limit` rows; `max_tokens` overrides the job's sampling.max_tokens).

    Raises ValueError (a JobError or an InputError) naming the job file or input when either is wrong."""
    from batchinfer.io.readers import Row, iter_rows, list_input_files
    from batchinfer.job.prompts import RowError
    from batchinfer.job.requests import RequestBuilder
    from batchinfer.job.spec import load_job

    if not Path(path).is_file():
        raise FileNotFoundError(f"--workload {path}: no such job file")
    spec = load_job(path)
    constraint = spec.structured.constraint() if spec.structured is not None else None
    builder = RequestBuilder(spec, tokenizer, max_model_len, constraint)
    if max_tokens is not None:
        builder.sampling = replace(builder.sampling, max_tokens=max_tokens)
    files = list_input_files(spec.input.path, "jsonl" if spec.input.format == "openai" else spec.input.format)
    requests, bad = [], 0
    for batch in iter_rows(files, spec.input.id_column, spec.input.batch_size, builder.prompts.columns):
        for item in batch:
            if limit is not None and len(requests) >= limit:
                break
            if not isinstance(item, Row):
                bad += 1
                continue
            try:
                requests += builder.build(item, str(item.values.get(spec.input.id_column)))
            except RowError:
                bad += 1
    if not requests:
        raise ValueError(f"--workload {path}: the job's input has no usable rows")
    kind = "JSON schema" if spec.structured is not None and spec.structured.json_schema is not None else (
        "constrained" if constraint is not None else "free text")
    desc = (f"job {Path(path).name}: {len(requests)} requests from {spec.input.path} ({kind}, "
            f"max_tokens {builder.sampling.max_tokens}, temperature {builder.sampling.temperature:g})")
    if bad:
        desc += f", {bad} rows left out"
    return Workload(Path(path).name, desc, requests)
