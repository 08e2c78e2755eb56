"""`bench job`: the corpus, the shapes' tokenizers, and the whole benchmark on the tiny model (CPU)."""

from __future__ import annotations

import json
import re

import polars as pl
import pytest
from typer.testing import CliRunner

from batchinfer.bench.corpus import CHARS_PER_TOKEN, CorpusSpec, document, write_corpus
from batchinfer.bench.shapes import SHAPES, TOKENIZER_FIT


def test_the_corpus_is_deterministic_prose_of_the_asked_size(tmp_path):
    spec = CorpusSpec(docs=9, shards=2, min_tokens=200, max_tokens=400, seed=3)
    a = write_corpus(spec, tmp_path / "a")
    b = write_corpus(spec, tmp_path / "b")
    ta, tb = pl.read_parquet(a), pl.read_parquet(b)
    assert ta.equals(tb) and ta.height == 9 and len(a) == 2
    assert sorted(ta["doc_id"].to_list()) == [f"doc-{i:07d}" for i in range(9)]
    assert write_corpus(spec, tmp_path / "a") == a  # found again, not rebuilt
    other = pl.read_parquet(write_corpus(CorpusSpec(docs=9, shards=2, min_tokens=200, max_tokens=400, seed=4), tmp_path / "c"))
    assert not other["text"].equals(ta["text"])
    for text in ta["text"].to_list():
        assert 200 * CHARS_PER_TOKEN <= len(text) <= 400 * CHARS_PER_TOKEN + 1200  # whole paragraphs
        words = re.findall(r"[A-Za-z]+", text)
        assert len(words) > 0.12 * len(text)  # words and spaces, not id soup
        assert text.count(". ") + text.count(".\n") > 5 and "\n\n" in text
    assert document(3, 5, 300) == document(3, 5, 300)  # a document depends on (seed, index) only


def test_a_cut_qwen_vocabulary_still_encodes_any_text(tmp_path):
    from batchinfer.real_tokenizer import build_qwen_tokenizer

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = build_qwen_tokenizer(tmp_path, num_ranks=3000, specials=specials)
    assert len(tok) == 3003 and tok.eos_token_id == 3002
    text = document(0, 1, 300)[1] + " Zürich — naïve 😀 ∑"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert max(ids) < 3000 and tok.decode(ids) == text


def test_the_llama_shape_gets_a_tokenizer_that_fits_its_vocabulary():
    fit = TOKENIZER_FIT["llama-3.1-8b"]
    shape = SHAPES["llama-3.1-8b"]
    assert fit["num_ranks"] + len(fit["specials"]) == shape["vocab_size"]
    assert fit["num_ranks"] + fit["specials"].index("<|im_end|>") == shape["eos_token_id"]
    assert len(set(fit["specials"])) == len(fit["specials"]) and "<|im_start|>" in fit["specials"]
    for name in ("qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b"):
        assert name not in TOKENIZER_FIT and SHAPES[name]["vocab_size"] >= 151851  # Qwen's own vocabulary fits


@pytest.mark.slow
def test_bench_job_end_to_end_on_the_tiny_model(tiny_model, tmp_path):
    from batchinfer.cli import app

    out = tmp_path / "numbers.json"
    r = CliRunner().invoke(app, [
        "bench", "job", "--model", str(tiny_model), "--docs", "6", "--shards", "2", "--min-tokens", "20",
        "--max-tokens", "50", "--max-new-tokens", "4", "--workdir", str(tmp_path / "work"), "--json", str(out),
        "--progress-interval", "0.5", "--set", "engine.device=cpu", "--set", "engine.num_kv_blocks=128",
        "--set", "engine.max_num_seqs=4",
    ])
    assert r.exit_code == 0, r.output
    assert "run / engine alone" in r.output and "command to first engine step" in r.output
    n = json.loads(out.read_text())
    assert n["run"]["rows"] == 6 and n["engine_alone"]["requests"] == 6
    assert n["run"]["wall_s"] > 0 and n["run"]["output_tokens"] > 0 and n["engine_alone"]["output_tokens"] > 0
    assert 0 < n["ratio"]["output_tokens_per_s"] and 0 < n["ratio"]["total_tokens_per_s"]
    # the same prompts went to the engine alone as to the run
    assert n["engine_alone"]["prompt_tokens"] == n["run"]["prompt_tokens"]
    s, t = n["breakdown"]["startup"], n["breakdown"]["teardown"]
    for key in ("imports", "engine_before_model_load", "model_load", "input_scan_and_id_check", "tokenizer_load",
                "grammar_compile", "first_step_at"):
        assert s[key] is not None and s[key] >= 0, key
    for key in ("generation", "report_writing", "exit"):
        assert t[key] is not None and t[key] >= 0, key
    assert n["breakdown"]["command_to_first_step_s"] <= n["run"]["wall_s"]
    # a short run of the same job went first (so the measured one finds the on-disk caches), in its own folder
    w = n["warm_up"]
    assert w["docs"] == 6 and 0 < w["command_to_first_step_s"] <= w["wall_s"] and w["startup"]["engine_start"] > 0
    assert "the warm-up run before it" in r.output and (tmp_path / "work" / "warm-up" / "out").is_dir()
