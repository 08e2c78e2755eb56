"""sampling.logprobs and sampling.n: the engine's numbers against transformers, the job's columns against the engine's."""

from __future__ import annotations

import json
import math
import random

import polars as pl
import pytest
import torch

from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams
from batchinfer.io import layout
from batchinfer.structured.base import Constraint


@pytest.fixture(scope="module")
def engine(tiny_model):
    return Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=256, block_size=8))


@pytest.fixture(scope="module")
def hf(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()


def hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of transformers' float32 logits at every output position: [len(output), V]."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(output)].log_softmax(-1)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(4, 30))] for _ in range(n)]


def test_greedy_logprobs_match_transformers(engine, hf):
    ps = prompts(3)
    reqs = [Request(f"g{i}", p, SamplingParams(max_tokens=8, temperature=0.0, logprobs=5)) for i, p in enumerate(ps)]
    reqs += [Request("k0", ps[0], SamplingParams(max_tokens=4, temperature=0.0, logprobs=0)),
             Request("off", ps[0], SamplingParams(max_tokens=4, temperature=0.0))]
    res = {r.request_id: r for r in engine.generate(reqs)}
    for i, p in enumerate(ps):
        r = res[f"g{i}"]
        assert len(r.logprobs) == len(r.output_token_ids) == r.completion_tokens
        ref = hf_logprobs(hf, p, r.output_token_ids)
        for j, t in enumerate(r.logprobs):
            assert t.token_id == r.output_token_ids[j]
            assert t.logprob == pytest.approx(ref[j, t.token_id].item(), abs=1e-4)
            top = ref[j].topk(5)
            assert [a for a, _ in t.top] == top.indices.tolist()
            assert [v for _, v in t.top] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert t.top[0][0] == t.token_id  # greedy: the chosen token is the most likely
    assert all(t.top == () for t in res["k0"].logprobs) and len(res["k0"].logprobs) == 4
    assert res["off"].logprobs is None


def test_sampled_logprobs_are_of_the_untempered_distribution(engine, hf):
    """temperature and top-k choose the token; the reported numbers are the model's own (temperature 1)."""
    p = prompts(1, seed=5)[0]
    (r,) = engine.generate([Request("s", p, SamplingParams(max_tokens=10, temperature=1.7, top_k=40, seed=11, logprobs=3))])
    ref = hf_logprobs(hf, p, r.output_token_ids)
    for j, t in enumerate(r.logprobs):
        assert t.logprob == pytest.approx(ref[j, t.token_id].item(), abs=1e-4)
        assert [a for a, _ in t.top] == ref[j].topk(3).indices.tolist()
    assert any(t.top[0][0] != t.token_id for t in r.logprobs), "at temperature 1.7 some token should not be the top one"


def test_constrained_logprobs_cover_only_allowed_tokens(engine):
    """Under a grammar the distribution is over the tokens the row may pick: masked ones never appear."""
    options = ["yes", "no", "maybe"]
    (r,) = engine.generate([Request("c", [5, 9, 11], SamplingParams(max_tokens=10, temperature=0.0, logprobs=20),
                                    Constraint.choice(options))])
    assert r.finish_reason == "stop" and r.text in options
    first = r.logprobs[0]
    starts = [engine.tokenizer.decode([a]) for a, _ in first.top]
    assert starts and all(any(o.startswith(t) for o in options) for t in starts), starts  # each begins an option
    assert sum(math.exp(v) for _, v in first.top) == pytest.approx(1.0, abs=1e-5)  # renormalised over the allowed
    assert first.top[0][0] == first.token_id


def test_identical_prompts_prefill_once(tiny_model):
    """n answers of one row are n requests of one prompt: the scheduler lets the first compute it."""
    steps = []
    e = Engine(EngineConfig(model=str(tiny_model), dtype="float32", device="cpu", num_kv_blocks=256, block_size=8),
               on_step=steps.append)
    p = prompts(1, seed=9)[0] + prompts(1, seed=10)[0] + prompts(1, seed=11)[0]
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    out = {r.request_id: r for r in e.generate([Request(f"a{i}", p, params[i]) for i in range(4)])}
    prefill = sum(s.num_prefill_tokens for s in steps)
    assert prefill <= len(p) + 3 * 8, f"{prefill} prefill tokens for 4 x {len(p)}: the prompt was computed more than once"
    alone = {i: next(iter(e.generate([Request("x", p, params[i])]))) for i in (0, 3)}
    assert out["a0"].output_token_ids == alone[0].output_token_ids and out["a3"].output_token_ids == alone[3].output_token_ids
    # a shared start (a common system prompt) only: nothing waits, all four are admitted in the first step
    steps.clear()
    tails = prompts(4, seed=12)
    list(e.generate([Request(f"b{i}", p[:16] + t, params[i]) for i, t in enumerate(tails)]))
    assert steps[0].num_prefill_tokens == sum(16 + len(t) for t in tails)


# ---- through a job -------------------------------------------------------------------------------------


def job(model, tmp, **sampling) -> dict:
    return {
        "model": {"path": str(model), "dtype": "float32"},
        "input": {"path": str(tmp / "in.jsonl"), "id_column": "doc_id"},
        "output": {"path": str(tmp / "out"), "rows_per_part": 3},
        "prompt": {"template": "Doc: {{ text }}"},
        "sampling": {"max_tokens": 5, **sampling},
        "engine": {"max_num_seqs": 8, "device": "cpu", "num_kv_blocks": 128},
    }


def write_rows(tmp, n: int = 5) -> None:
    rows = [{"doc_id": f"d{i}", "text": f"invoice {i} total {i * 7}"} for i in range(n)]
    (tmp / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_logprob_columns_match_transformers(tiny_model, tmp_path, hf):
    from batchinfer.job.spec import load_job
    from batchinfer.models.loader import load_tokenizer
    from batchinfer.job.prompts import PromptBuilder
    from batchinfer.job import run_job as run

    write_rows(tmp_path)
    d = job(tiny_model, tmp_path, temperature=0.0, logprobs=3)
    d["output"]["format"] = "openai"
    spec = load_job(d)
    s = run(spec)
    assert s.rows_done == 5 and s.error_rows == 0
    df = pl.read_parquet(tmp_path / "out" / "*.parquet")
    assert df.schema["token_logprobs"] == pl.List(pl.Float64) and df.schema["token_ids"] == pl.List(pl.Int32)
    tokenizer = load_tokenizer(tiny_model)
    builder = PromptBuilder(spec.prompt, tokenizer)
    for row in df.iter_rows(named=True):
        _, prompt = builder.encode({"text": f"invoice {row['doc_id'][1:]} total {int(row['doc_id'][1:]) * 7}"})
        assert len(row["token_ids"]) == row["completion_tokens"] and row["prompt_tokens"] == len(prompt)
        ref = hf_logprobs(hf, prompt, row["token_ids"])
        for j, (tid, lp, top) in enumerate(zip(row["token_ids"], row["token_logprobs"], row["top_logprobs"])):
            assert lp == pytest.approx(ref[j, tid].item(), abs=1e-4)
            assert [t["token_id"] for t in top] == ref[j].topk(3).indices.tolist() and top[0]["token_id"] == tid
            assert [t["token"] for t in top] == [tokenizer.decode([t["token_id"]], skip_special_tokens=False) for t in top]
    # the same numbers in results.jsonl, as the OpenAI API lays them out
    lines = [json.loads(x) for x in layout.openai_paths(tmp_path / "out")[0].read_text().splitlines()]
    assert sorted(r["custom_id"] for r in lines) == sorted(df["doc_id"])
    for r in lines:
        row = df.filter(pl.col("doc_id") == r["custom_id"]).row(0, named=True)
        content = r["response"]["body"]["choices"][0]["logprobs"]["content"]
        assert [c["logprob"] for c in content] == row["token_logprobs"]
        assert [c["token"] for c in content] == [tokenizer.decode([t], skip_special_tokens=False) for t in row["token_ids"]]
        assert [[a["logprob"] for a in c["top_logprobs"]] for c in content] == [[t["logprob"] for t in top] for top in row["top_logprobs"]]


def test_n_answers_are_one_row_each_seeded_seed_plus_index(tiny_model, tmp_path):
    from batchinfer.job import run_job as run

    write_rows(tmp_path, 4)
    s = run(job(tiny_model, tmp_path, n=3, temperature=1.0, seed=5, ignore_eos=True, logprobs=1))
    assert s.rows_done == 4
    df = pl.read_parquet(tmp_path / "out" / "*.parquet").sort("doc_id")
    assert df["doc_id"].to_list() == ["d0", "d1", "d2", "d3"] and "output_text" not in df.columns
    for row in df.iter_rows(named=True):
        answers = row["answers"]
        assert len(answers) == 3 and row["completion_tokens"] == sum(a["completion_tokens"] for a in answers) == 15
        assert row["finish_reason"] == "length" and row["error"] is None
        assert len({tuple(a["token_ids"]) for a in answers}) > 1, "the answers of a row should differ"
        assert all(len(a["token_logprobs"]) == 5 for a in answers)
    # answer i is the answer of an n = 1 job with seed 5 + i (answer 0 has the job's seed by construction)
    for i in (2,):
        (tmp_path / f"one{i}").mkdir()
        d = job(tiny_model, tmp_path, temperature=1.0, seed=5 + i, ignore_eos=True)
        d["output"] = {"path": str(tmp_path / f"one{i}")}
        run(d)
        one = pl.read_parquet(tmp_path / f"one{i}" / "*.parquet").sort("doc_id")
        assert one["output_text"].to_list() == [a[i]["output_text"] for a in df["answers"].to_list()]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, tol", [("float32", 2e-3), ("bfloat16", 0.15)])
def test_gpu_logprobs_match_transformers(tiny_model, hf, dtype, tol):
    """On the GPU (CUDA-graph decode and mixed steps, the fused sampling kernel for the sampled rows):
    logprobs against transformers' float32 ones on the CPU; the same tokens are chosen."""
    e = Engine(EngineConfig(model=str(tiny_model), dtype=dtype, device="cuda", attention_backend="triton",
                            max_num_seqs=16, num_kv_blocks=512))
    ps = prompts(12, seed=3)
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=4 if i % 3 else None,
                                               temperature=0.0 if i % 2 else 0.9, seed=i)) for i, p in enumerate(ps)]
    res = {r.request_id: r for r in e.generate(reqs)}
    for i, p in enumerate(ps):
        r = res[f"r{i}"]
        if i % 3 == 0:
            assert r.logprobs is None
            continue
        assert len(r.logprobs) == len(r.output_token_ids) == 12
        ref = hf_logprobs(hf, p, r.output_token_ids)
        for j, t in enumerate(r.logprobs):
            assert t.token_id == r.output_token_ids[j]
            assert t.logprob == pytest.approx(ref[j, t.token_id].item(), abs=tol)
            if i % 2 and dtype == "float32":  # greedy: the chosen token is the top one
                assert t.top[0][0] == t.token_id
