"""bench/job_workload.py: a job file's rows as a benchmark workload, as `batchinfer run` would send them."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchinfer.bench.job_workload import is_job_file, job_workload
from batchinfer.models.loader import load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "jobs" / "quickstart.yaml"


def test_quickstart_job_as_workload(tiny_model):
    tok = load_tokenizer(tiny_model)
    wl = job_workload(JOB, tok, 4096)
    rows = [line for line in (ROOT / "examples" / "data" / "invoices.jsonl").read_text().splitlines() if line.strip()]
    assert len(wl.requests) == len(rows) == 24
    first = wl.requests[0]
    assert first.request_id == "inv-001" and "Nordlicht Software GmbH" in first.prompt
    assert first.prompt_token_ids == list(tok(first.prompt, add_special_tokens=not tok.chat_template)["input_ids"])
    assert first.constraint is not None and first.constraint.kind == "json_schema"
    assert first.sampling.max_tokens == 96 and first.sampling.temperature == 0.0
    short = job_workload(JOB, tok, 4096, max_tokens=8, limit=3)
    assert [r.request_id for r in short.requests] == ["inv-001", "inv-002", "inv-003"]
    assert {r.sampling.max_tokens for r in short.requests} == {8}
    assert is_job_file("jobs/quickstart.yaml") and not is_job_file("docs1000-json")


def test_bad_job_files_name_the_problem(tiny_model, tmp_path):
    tok = load_tokenizer(tiny_model)
    with pytest.raises(FileNotFoundError, match="no such job file"):
        job_workload(tmp_path / "missing.yaml", tok, 4096)
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {path: m}\ninput: {path: nowhere.jsonl, id_column: id}\noutput: {path: out}\nprompt: {template: '{{ text }}'}\n")
    with pytest.raises(ValueError, match="nowhere.jsonl"):
        job_workload(bad, tok, 4096)
