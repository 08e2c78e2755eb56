"""Start-up: the preflight (id scan, tokenizer, grammar) runs on threads while the engine loads, the engine
takes its tokenizer and compiled grammar instead of making them again, and the run records its phases."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

import batchinfer.structured.compiler as compiler_module
from batchinfer.job import run_job
from batchinfer.job.phases import PhaseTimer


def _job(model, tmp_path, **over):
    pq.write_table(pa.Table.from_pylist([{"doc_id": i, "text": f"invoice {i} total {3 * i}"} for i in range(5)]),
                   tmp_path / "in.parquet")
    d = {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": str(tmp_path / "in.parquet"), "id_column": "doc_id"},
        "output": {"path": str(tmp_path / "out")},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 3},
        "structured": {"choice": ["yes", "no"]},
        "engine": {"max_num_seqs": 4, "device": "cpu", "num_kv_blocks": 64},
    }
    d.update(over)
    return d


def test_the_preflight_overlaps_the_engine_load_which_reuses_its_tokenizer_and_grammar(tiny_model, tmp_path, monkeypatch):
    from batchinfer.models.tokenizer import FastTokenizer

    loads, compilers = [], []
    real_load = FastTokenizer.__init__
    real_init = compiler_module.GrammarCompiler.__init__

    def load(self, *a, **k):
        loads.append(a[0])
        real_load(self, *a, **k)

    def init(self, *a, **k):
        compilers.append(1)
        real_init(self, *a, **k)

    monkeypatch.setattr(FastTokenizer, "__init__", load)
    monkeypatch.setattr(compiler_module.GrammarCompiler, "__init__", init)
    timer = PhaseTimer()
    s = run_job(_job(tiny_model, tmp_path), phases=timer, report=True)
    assert s.this_run_rows == 5
    assert len(loads) == 1, loads  # before: the plan's schema check and the engine loaded their own
    assert len(compilers) == 1  # the engine used the preflight's compiler (its constraint already compiled)

    assert s.phases is not None
    spans = {p["name"]: p for p in s.phases["spans"]}
    marks = s.phases["marks"]
    for name in ("load_job", "plan", "input_scan", "tokenizer", "grammar_compile", "engine_start", "engine.model_load",
                 "engine.kv_cache", "preflight_wait", "report"):
        assert name in spans, name
    engine = spans["engine_start"]
    for name in ("input_scan", "tokenizer", "grammar_compile"):
        # started on their threads before the engine had finished loading: they overlap it
        assert spans[name]["thread"] != engine["thread"]
        assert spans[name]["start_s"] < engine["end_s"]
    assert spans["plan"]["end_s"] <= engine["start_s"]
    assert engine["end_s"] <= marks["engine_ready"] <= marks["first_step"] <= marks["first_row_done"]
    assert marks["first_row_done"] <= marks["last_row_done"] <= marks["parts_committed"] <= marks["summary"]
    assert marks["summary"] <= spans["report"]["start_s"] <= spans["report"]["end_s"] <= marks["run_job_end"]
    # the report holds the phases up to its own writing
    import json

    report = json.loads((tmp_path / "_out.batchinfer" / "report.json").read_text())
    assert report["run"]["summary"]["phases"]["marks"]["first_step"] == marks["first_step"]


def test_the_summary_is_handed_over_before_the_report_is_written(tiny_model, tmp_path):
    seen = []

    def on_summary(s):
        seen.append((s.this_run_rows, (tmp_path / "_out.batchinfer" / "report.json").exists(), s.report_path))

    s = run_job(_job(tiny_model, tmp_path), on_summary=on_summary)
    assert seen == [(5, False, str(tmp_path / "_out.batchinfer" / "report.html"))]
    assert (tmp_path / "_out.batchinfer" / "report.json").exists() and s.report_path == seen[0][2]


def test_rows_are_rendered_and_tokenised_while_the_engine_loads(tiny_model, tmp_path, monkeypatch):
    """Stage 3 starts before the engine is ready (stage.start_prompts): the first batch is prepared
    during engine_start, and every row comes out once, with the prompt the job's template gives."""
    import time

    import polars as pl

    from batchinfer.job import stage
    from batchinfer.job.prompts import PromptBuilder
    from batchinfer.job.spec import PromptSpec
    from batchinfer.models.loader import load_tokenizer

    calls: list[float] = []
    real = stage.prepare_batch

    def prepare(prompts, items):
        calls.append(time.perf_counter())
        return real(prompts, items)

    def slow_engine(spec, on_step=None):  # a real model's load takes seconds; this tiny one's, milliseconds
        time.sleep(1.0)
        return stage.make_engine(spec, on_step)

    monkeypatch.setattr(stage, "prepare_batch", prepare)
    timer = PhaseTimer()
    s = run_job(_job(tiny_model, tmp_path), phases=timer, engine_factory=slow_engine)
    assert s.this_run_rows == 5 and s.error_rows == 0
    engine = next(p for p in s.phases["spans"] if p["name"] == "engine_start")
    assert calls and calls[0] - timer.origin < engine["end_s"] - 0.5, (calls, engine)
    out = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("doc_id")
    assert out["doc_id"].to_list() == list(range(5))
    builder = PromptBuilder(PromptSpec(template="Doc: {{ text }}"), load_tokenizer(tiny_model))
    want = [len(ids) for _, ids in builder.encode_many([{"text": f"invoice {i} total {3 * i}"} for i in range(5)])]
    assert out["prompt_tokens"].to_list() == want
