"""FP8 weights on the real SmolLM2-135M-Instruct (tests/conftest.py `smollm2`), CPU (the dequantised path).

Workload: six chat prompts over the example invoices (examples/data/invoices.jsonl), a question each,
32 greedy tokens from the float32 engine. Agreement: the FP8 model (model.quantization fp8, float32
compute) run over each prompt + the float32 answer (teacher forcing), its argmax at every answer
position against the float32 token there. Measured 2026-12-01: 119/131 = 90.8% (on eight such
prompts: bfloat16 weights unquantised 98.9%, FP8 weights with FP8 activations 92.7%, FP8 weights
alone 94.4%: most of the loss is the weights' 3 mantissa bits on a 135M model). The floor leaves
room for the CPU's float rounding to move a near tie or two. The FP8 KV cache (engine.kv_cache_dtype
fp8_e4m3, scale 1.0; max |K| 23, |V| 14 on this workload) with float32 weights: 126/131 = 96.2%
(scale 0.1, which uses more of e4m3's range: 97.7%). Slow: about a minute of CPU each.

Where the FP8-weights loss comes from (2026-12-01, this workload, the FP8 math emulated on the float32
model per projection: weights dequantised, inputs fake-quantised per token; agreement, and the mean KL
of the answer positions' next-token distributions against float32):
  all projections W+A 119/131 = 90.8% (KL 0.032) | weights only 93.9% (0.016) | activations only 97.7% (0.008)
  all but qkv in 16-bit 91.6% (0.020) | but o 91.6% (0.027) | but gate/up 95.4% (0.015) | but down 92.4% (0.019)
  all but decoder layer 0 91.6% (0.026) | all but the last layer (29) 95.4% (0.020) | but both 95.4% (0.018)
  all but layer 29's down 92.4% (0.025) | all but layer 29's gate/up 93.1% (0.024)
The weights' rounding costs more than the activations', gate/up and the last decoder layer most; no
one projection explains it. The LM head and the embeddings are already 16-bit (tied on this model).
Only keeping whole layers or all gate/up projections in 16-bit reaches 95%, and that is a speed
trade (gate/up is ~45% of a layer's FLOPs), so the default stays: every decoder projection in FP8.

The quickstart's JSON extraction (tests/test_real_model.py's exact-match share over the 24
invoices) with model.quantization fp8 scored 83/120 = 69.2%, the same share as float32 (69.2%).

On a larger workload (scripts/fp8_accuracy.py: 48 prompts, 1,099 answer positions, 2026-12-02) the
FP8 KV cache agrees on 95.9% (scale 1.0) and 96.4% (kv_cache_scale auto); the quickstart extraction
with an FP8 cache scored 85/120 = 70.8% at scale 1.0 (float32: 69.2%) and 79/120 = 65.8% with auto
scales. test_fp8_kv_cache_extraction_within_two_points keeps the default (scale 1.0) within 2 points
of float32's measured share.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from paged_batch import PagedSequences, make_caches
from quickstart_score import FLOAT32_EXACT_MATCH, describe, run_quickstart, score, share

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "examples" / "data" / "invoices.jsonl"
QUESTIONS = ("Who issued this document?", "What is the total?", "What is the date?", "Summarize this document in one sentence.")
NEW_TOKENS = 32
WEIGHTS_FLOOR = 0.88
KV_FLOOR = 0.93


def _prompts(tokenizer) -> list[list[int]]:
    docs = [json.loads(line) for line in DOCS.read_text().splitlines() if line.strip()]
    out = []
    for i in range(6):
        conv = [{"role": "user", "content": f"{docs[i]['text']}\n\n{QUESTIONS[i % len(QUESTIONS)]}"}]
        out.append(list(tokenizer.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]))
    return out


@pytest.fixture(scope="module")
def reference(smollm2):
    """(prompts, float32 greedy answers) of the workload."""
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    with Engine(EngineConfig(model=str(smollm2), dtype="float32", device="cpu", num_kv_blocks=128)) as engine:
        prompts = _prompts(engine.tokenizer)
        ref = {r.request_id: r.output_token_ids for r in engine.generate([Request(str(i), p, sp) for i, p in enumerate(prompts)])}
    return prompts, [ref[str(i)] for i in range(len(prompts))]


def _agreement(smollm2, reference, quantization: str, kv_dtype: torch.dtype, kv_scale: float = 1.0) -> tuple[int, int]:
    """Teacher-forced: the model's argmax at every answer position against the float32 answer token."""
    from batchinfer.attention import get_attention_backend
    from batchinfer.models.loader import load_model

    prompts, answers = reference
    backend = get_attention_backend("torch", "cpu", kv_scale=kv_scale)
    model, info = load_model(str(smollm2), "float32", "cpu", backend, quantization=quantization)
    seqs = PagedSequences(256, 16)
    caches = make_caches(info.num_layers, 256, 16, info.num_kv_heads, info.head_dim, dtype=kv_dtype)
    ids, positions, meta = seqs.step([(seqs.add(), p + a[:-1]) for p, a in zip(prompts, answers)])
    with torch.inference_mode():
        hidden = model(ids, positions, caches, meta)
    agree = total = start = 0
    for p, a in zip(prompts, answers):
        rows = hidden[start + len(p) - 1 : start + len(p) - 1 + len(a)]
        pred = model.compute_logits(rows).argmax(-1).tolist()
        agree += sum(x == y for x, y in zip(pred, a))
        total += len(a)
        start += len(p) + len(a) - 1
    return agree, total


@pytest.mark.slow
def test_fp8_weights_greedy_tokens_agree_with_float32(smollm2, reference):
    agree, total = _agreement(smollm2, reference, "fp8", torch.float32)
    print(f"\nFP8 weights vs float32, teacher-forced greedy agreement: {agree}/{total} = {agree / total:.1%}")
    assert total >= 5 * len(reference[0])
    assert WEIGHTS_FLOOR <= agree / total < 1.0  # < 1: the weights really are FP8


@pytest.mark.slow
def test_fp8_kv_cache_greedy_tokens_agree_with_float32(smollm2, reference):
    agree, total = _agreement(smollm2, reference, "none", torch.float8_e4m3fn, kv_scale=1.0)
    print(f"\nFP8 KV cache (scale 1.0) vs float32, teacher-forced greedy agreement: {agree}/{total} = {agree / total:.1%}")
    assert KV_FLOOR <= agree / total < 1.0


@pytest.mark.slow
def test_fp8_kv_cache_extraction_within_two_points(smollm2, tmp_path):
    """The quickstart's JSON extraction with engine.kv_cache_dtype fp8_e4m3 (the float32 engine on the
    CPU: the cache stores e4m3, read back times its scale): every answer valid, and the exact-match
    share at most 2 points under float32's."""
    import polars as pl

    run_quickstart(smollm2, tmp_path / "out", ["engine.kv_cache_dtype=fp8_e4m3"])
    rows = pl.read_parquet(str(tmp_path / "out" / "*.parquet")).to_dicts()
    hits = score(rows)
    print(f"\nFP8 KV cache, quickstart exact match: {describe(hits, len(rows))} (float32 {FLOAT32_EXACT_MATCH:.1%})")
    assert share(hits, len(rows)) >= FLOAT32_EXACT_MATCH - 0.02, hits
