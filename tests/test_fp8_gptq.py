"""FP8 checkpoints rounded with GPTQ (batchinfer/convert/fp8_gptq.py, `batchinfer quantize-fp8`).

On random models: the grid is the engine's (e4m3 values times per-channel scales amax/448), the
checkpoint loads as FP8 as it is, GPTQ's rounding keeps a layer's outputs on calibration inputs
closer than rounding to nearest does, and the CLI names what is wrong. The accuracy on the real
SmolLM2 (BENCHMARKS.md) is a long test: BATCHINFER_LONG_TESTS=1.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from paged_batch import PagedSequences, make_caches
from typer.testing import CliRunner

from batchinfer.cli import app
from batchinfer.convert.fp8_gptq import fake_quant_tokens, gptq_fp8, quantize_checkpoint
from batchinfer.models.quant import dequantize_rows, quantize_rows

ROOT = Path(__file__).resolve().parents[1]


def _rtn(w: torch.Tensor) -> torch.Tensor:
    """w rounded to nearest on the engine's grid (what model.quantization fp8 does at load), widened."""
    return dequantize_rows(*quantize_rows(w))


def _scales(w: torch.Tensor) -> torch.Tensor:
    """The engine's per-channel scales of w, [N, 1]."""
    return quantize_rows(w)[1].reshape(-1, 1)


def test_gptq_keeps_outputs_closer_than_rounding_to_nearest():
    """One projection with correlated inputs (as activations are): the output error its weights'
    rounding causes on the calibration inputs, GPTQ against round-to-nearest on the same grid."""
    gen = torch.Generator().manual_seed(0)
    k, n, t = 96, 48, 512
    mix = torch.randn(k, k, generator=gen) / k ** 0.5
    x = torch.randn(t, k, generator=gen) @ (torch.eye(k) + 3 * mix)
    w = torch.randn(n, k, generator=gen)
    xq = fake_quant_tokens(x)
    q, scale = gptq_fp8(w, (xq.T @ xq).double() / t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (n, 1)
    assert torch.equal(scale, _scales(w))  # the engine's scales: the grid is the same
    ref = xq @ w.T  # the weights' part of the error (the inputs' rounding is the same for both)
    err_gptq = (xq @ (q.float() * scale).T - ref).norm()
    err_rtn = (xq @ _rtn(w).T - ref).norm()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)


def _calibration(vocab: int, n: int = 6, length: int = 48) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def _logits(path: Path, quantization: str, prompts) -> torch.Tensor:
    from batchinfer.attention import get_attention_backend
    from batchinfer.models.loader import load_model

    model, info = load_model(str(path), "float32", "cpu", get_attention_backend("torch", "cpu"), quantization=quantization)
    seqs = PagedSequences(128, 8, seed=1)
    caches = make_caches(info.num_layers, 128, 8, info.num_kv_heads, info.head_dim)
    ids, positions, meta = seqs.step([(seqs.add(), p) for p in prompts])
    with torch.inference_mode():
        return model.compute_logits(model(ids, positions, caches, meta)), info


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_checkpoint_loads_as_fp8_and_beats_rounding_at_load(model_factory, tmp_path, family):
    from safetensors.torch import load_file

    src = model_factory(family)
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    calib = _calibration(vocab)
    report = quantize_checkpoint(src, tmp_path / "fp8", calib)
    assert report.projections == 7 * report.layers and report.calibration_tokens == sum(map(len, calib))
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    original = load_file(str(next(src.glob("*.safetensors"))))
    w = "model.layers.0.mlp.down_proj.weight"
    assert stored[w].dtype == torch.float8_e4m3fn
    assert torch.allclose(stored[w.replace("weight", "weight_scale")], _scales(original[w]))
    assert not torch.equal(stored[w].view(torch.uint8), quantize_rows(original[w])[0].view(torch.uint8))  # not rounded to nearest
    # the engine loads it as stored (an FP8 checkpoint), and on the calibration text its logits are
    # closer to the float model's than those of the same weights rounded at load
    ref, _ = _logits(src, "none", calib)
    gptq, info = _logits(tmp_path / "fp8", "none", calib)
    rtn, _ = _logits(src, "fp8", calib)
    assert info.quantization == "fp8"
    assert (gptq - ref).norm() < (rtn - ref).norm()


def test_a_16_bit_checkpoint_keeps_its_other_tensors_16_bit(model_factory, tmp_path):
    from safetensors.torch import load_file

    src = model_factory("qwen3", torch_dtype="bfloat16")
    quantize_checkpoint(src, tmp_path / "fp8", _calibration(512, n=2, length=16))
    stored = load_file(str(tmp_path / "fp8" / "model.safetensors"))
    assert stored["model.norm.weight"].dtype == torch.bfloat16
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert stored["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn


def test_cli_writes_a_checkpoint_and_names_what_is_wrong(model_factory, tmp_path):
    src = model_factory("llama")
    rows = tmp_path / "cal.jsonl"
    rows.write_text("\n".join(json.dumps({"text": f"calibration row {i}: the total is {i * 7} EUR"}) for i in range(5)) + "\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["quantize-fp8", str(src), str(tmp_path / "out"), "--calibration", str(rows), "--no-chat"])
    assert ok.exit_code == 0, ok.output
    assert "projections" in ok.output and (tmp_path / "out" / "config.json").is_file()
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    again = runner.invoke(app, ["quantize-fp8", str(src), str(tmp_path / "out"), "--calibration", str(rows)])
    assert again.exit_code == 2 and "not empty" in again.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    r = runner.invoke(app, ["quantize-fp8", str(src), str(tmp_path / "o2"), "--calibration", str(bad)])
    assert r.exit_code == 2 and "line 1" in r.output and "'text'" in r.output
    r = runner.invoke(app, ["quantize-fp8", str(tmp_path), str(tmp_path / "o3"), "--calibration", str(rows)])
    assert r.exit_code == 2 and "no config.json" in r.output


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("BATCHINFER_LONG_TESTS"), reason="long (minutes of CPU): BATCHINFER_LONG_TESTS=1")
def test_gptq_on_smollm2_agrees_more_than_rounding_at_load(smollm2, tmp_path):
    """SmolLM2-135M-Instruct, calibrated on examples/data/docs.jsonl with questions (not the evaluated invoices):
    teacher-forced greedy agreement with float32 over 48 invoice prompts x 32 tokens."""
    from test_fp8_real import QUESTIONS, _agreement

    from batchinfer.convert.fp8_gptq import calibration_ids
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

    docs = [json.loads(line) for line in (ROOT / "examples" / "data" / "invoices.jsonl").read_text().splitlines() if line.strip()]
    with Engine(EngineConfig(model=str(smollm2), dtype="float32", device="cpu", num_kv_blocks=512)) as engine:
        tok = engine.tokenizer
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": f"{docs[i % 24]['text']}\n\n{QUESTIONS[(i // 24 + i) % 4]}"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]) for i in range(48)]
        sp = SamplingParams(max_tokens=32, temperature=0.0)
        out = {r.request_id: r.output_token_ids for r in engine.generate([Request(str(i), p, sp) for i, p in enumerate(prompts)])}
    reference = (prompts, [out[str(i)] for i in range(48)])
    # calibration rows: the other example documents, each with two of the questions (44 rows)
    other = [json.loads(line)["text"] for line in (ROOT / "examples" / "data" / "docs.jsonl").read_text().splitlines() if line.strip()]
    rows = tmp_path / "calibration.jsonl"
    rows.write_text("".join(json.dumps({"text": f"{d}\n\n{q}"}) + "\n" for q in QUESTIONS[:2] for d in other))
    calib = calibration_ids(rows, tok, samples=44)
    quantize_checkpoint(smollm2, tmp_path / "fp8", calib)
    def agreement(path, quantization):  # in chunks of six prompts: _agreement's KV pool holds 4,096 tokens
        got = [_agreement(path, (prompts[i:i + 6], reference[1][i:i + 6]), quantization, torch.float32) for i in range(0, 48, 6)]
        return sum(a for a, _ in got), sum(t for _, t in got)

    g, total = agreement(tmp_path / "fp8", "none")
    r, _ = agreement(smollm2, "fp8")
    print(f"\nFP8 W+A agreement with float32 over {total} positions: GPTQ {g / total:.1%}, rounding at load {r / total:.1%}")
    assert g / total >= 0.93 and g > r + 0.01 * total  # measured 2026-12-01: 1035/1099 = 94.2% against 1016 = 92.4%
