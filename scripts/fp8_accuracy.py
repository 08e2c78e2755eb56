"""FP8 accuracy on the real SmolLM2-135M-Instruct, emulated on transformers' float32 model (CPU).

Teacher-forced greedy agreement with float32: 48 chat prompts (the 24 example invoices x the four
questions, cycled), 32 greedy tokens each from transformers' `generate`; then, per variant, the
model's argmax at every answer position against the float32 token there. A variant replaces each
decoder projection's weight by its FP8 rounding (dequantised) and/or fake-quantises its input per
token (e4m3, scale amax/448), which is the math of the engine's dequantised FP8 path.

    python3 scripts/fp8_accuracy.py [--variants act,rtn,rtn-w,gptq,gptq-w,kv,kv-auto] [--held-out]
        [--calibration-rows 44] [--extraction none,kv,kv-auto,fp8]

act: float32 weights, FP8 activations; rtn / rtn-w: weights rounded to nearest with / without FP8
activations; gptq / gptq-w: weights rounded by batchinfer/convert/fp8_gptq.py (calibrated on
examples/data/docs.jsonl with questions; --held-out also calibrates on invoices 0-11 and evaluates
only invoices 12-23). --only PROJ[,PROJ] limits the FP8 activations of `act` to those projections.
kv / kv-auto: float32 weights and activations, the KV cache in FP8 e4m3 (K after rotary and V, divided
by the scale, saturated at +-448, rounded, read back times it: kernels/reference.to_kv_cache), with
engine.kv_cache_scale's fixed 1.0 / its per-layer `auto` scales (engine/kv_calibration.py: amax over
the calibration texts x 2 / 448, measured here on the same model).
--extraction runs the quickstart job (jobs/quickstart.yaml: JSON extraction of the 24 invoices,
greedy) through `batchinfer.run` on the float32 engine with each setting (none; kv: an FP8 cache at
scale 1.0; kv-auto: calibrated scales; fp8: FP8 weights) and prints each one's exact-match share of
the five key fields against examples/data/invoices.truth.jsonl (tests/test_real_model.py's measure).
Numbers: BENCHMARKS.md, "FP8 accuracy on SmolLM2-135M".
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ("Who issued this document?", "What is the total?", "What is the date?", "Summarize this document in one sentence.")


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from batchinfer.convert.fp8_gptq import fake_quant_tokens, quantize_fp8_gptq
    from batchinfer.convert.get_model import default_model_dir, get_model
    from batchinfer.models.quant import dequantize_rows, quantize_rows

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="act,rtn,rtn-w,gptq,gptq-w")
    ap.add_argument("--held-out", action="store_true")
    ap.add_argument("--calibration-rows", type=int, default=44)
    ap.add_argument("--extraction", default="", help="quickstart exact match for these settings (none,kv,kv-auto,fp8)")
    ap.add_argument("--only", default=None, help="with act: FP8 inputs only for these projections (e.g. q_proj,k_proj,v_proj)")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = default_model_dir("smollm2-135m-instruct")
    get_model("smollm2-135m-instruct", path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def rows(name):
        return [json.loads(line) for line in (ROOT / "examples" / "data" / name).read_text().splitlines() if line.strip()]

    def chat(text, q):
        return list(tok.apply_chat_template([{"role": "user", "content": f"{text}\n\n{q}"}], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"])

    docs, other = rows("invoices.jsonl"), rows("docs.jsonl")
    keep = [i for i in range(48) if not args.held_out or i % 24 >= 12]
    prompts = [chat(docs[i % 24]["text"], QUESTIONS[(i // 24 + i) % 4]) for i in keep]
    with torch.inference_mode():
        answers = [model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist() for p in prompts]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    print(f"{sum(map(len, answers))} answer positions, {len(linears)} projections", flush=True)

    def agreement(activations: bool, only=None) -> tuple[int, int]:
        hooks = [m.register_forward_pre_hook(lambda _m, a: (fake_quant_tokens(a[0]),)) for n, m in linears.items()
                 if activations and (only is None or n.rsplit(".", 1)[-1] in only)]
        try:
            return teacher_forced(model, prompts, answers)
        finally:
            for h in hooks:
                h.remove()

    def set_weights(fn) -> None:
        for n, m in linears.items():
            m.weight.data = fn(original[n])

    def rtn(w):  # rounded to nearest, as model.quantization fp8 does at load
        return dequantize_rows(*quantize_rows(w))

    def report(name, result):
        a, t = result
        print(f"{name:55s} {a}/{t} = {100 * a / t:.1f}%", flush=True)

    variants = [v for v in args.variants.split(",") if v]
    if "kv" in variants or "kv-auto" in variants:
        set_weights(lambda w: w.clone())
        if "kv" in variants:
            report("FP8 KV cache, scale 1.0", kv_agreement(model, tok, prompts, answers, auto=False))
        if "kv-auto" in variants:
            report("FP8 KV cache, calibrated scales (kv_cache_scale auto)", kv_agreement(model, tok, prompts, answers, auto=True))
    if "act" in variants:
        set_weights(lambda w: w.clone())
        only = tuple(args.only.split(",")) if args.only else None
        report(f"float32 weights, FP8 activations{' on ' + args.only if only else ''}", agreement(True, only))
    if "rtn" in variants or "rtn-w" in variants:
        set_weights(rtn)
        if "rtn" in variants:
            report("FP8 weights rounded to nearest, FP8 activations", agreement(True))
        if "rtn-w" in variants:
            report("FP8 weights rounded to nearest, float32 activations", agreement(False))
    if "gptq" in variants or "gptq-w" in variants:
        set_weights(lambda w: w.clone())
        calib = [chat(d["text"], q)[:512] for q in QUESTIONS for d in other][: args.calibration_rows]
        if args.held_out:
            calib = calib[: max(0, args.calibration_rows - 12)] + [chat(docs[i]["text"], QUESTIONS[0])[:512] for i in range(12)]
        t = time.perf_counter()
        quantize_fp8_gptq(model, calib)
        print(f"GPTQ on {len(calib)} calibration rows: {time.perf_counter() - t:.0f} s", flush=True)
        if "gptq" in variants:
            report("FP8 weights by GPTQ, FP8 activations", agreement(True))
        if "gptq-w" in variants:
            report("FP8 weights by GPTQ, float32 activations", agreement(False))
    for setting in [x for x in args.extraction.split(",") if x]:
        print(f"extraction, {setting}: {extraction(path, setting)}", flush=True)


def teacher_forced(model, prompts, answers) -> tuple[int, int]:
    """(agreeing, all) answer positions: the model's argmax over each prompt + answer against the
    answer token there."""
    agree = total = 0
    with torch.inference_mode():
        for p, a in zip(prompts, answers):
            pred = model(torch.tensor([p + a[:-1]])).logits[0, len(p) - 1:].argmax(-1).tolist()
            agree += sum(x == y for x, y in zip(pred, a))
            total += len(a)
    return agree, total


def kv_agreement(model, tok, prompts, answers, auto: bool) -> tuple[int, int]:
    """Teacher-forced agreement of the float32 model whose attention reads K and V as an FP8 cache
    holds them (module docstring)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from batchinfer.engine.kv_calibration import CALIBRATION_TEXTS, scales_from_amax
    from batchinfer.kernels.reference import from_kv_cache, to_kv_cache

    fp8 = torch.float8_e4m3fn
    layers = model.config.num_hidden_layers
    amax = [[0.0, 0.0] for _ in range(layers)]
    state = {"scales": None}

    def attend(module, query, key, value, *rest, **kw):
        i = module.layer_idx
        if state["scales"] is None:  # calibration pass: record the largest |K| and |V|
            amax[i][0] = max(amax[i][0], float(key.abs().amax()))
            amax[i][1] = max(amax[i][1], float(value.abs().amax()))
        else:
            ks, vs = state["scales"][i]
            key = from_kv_cache(to_kv_cache(key, fp8, ks), key.dtype, ks)
            value = from_kv_cache(to_kv_cache(value, fp8, vs), value.dtype, vs)
        return sdpa_attention_forward(module, query, key, value, *rest, **kw)

    AttentionInterface.register("batchinfer_fp8_kv", attend)
    before = model.config._attn_implementation
    model.config._attn_implementation = "batchinfer_fp8_kv"
    try:
        if auto:
            with torch.inference_mode():
                for text in CALIBRATION_TEXTS:
                    model(torch.tensor([tok.encode(text)]))
            state["scales"] = scales_from_amax([tuple(a) for a in amax])
        else:
            state["scales"] = [(1.0, 1.0)] * layers
        return teacher_forced(model, prompts, answers)
    finally:
        model.config._attn_implementation = before


def extraction(model_dir, setting: str) -> str:
    """The quickstart job's exact-match share with one FP8 setting (module docstring), scored by
    tests/quickstart_score.py as the tests score it."""
    import sys
    import tempfile

    import polars as pl

    sys.path.insert(0, str(ROOT / "tests"))
    from quickstart_score import describe, run_quickstart, score

    overrides = {"none": [], "kv": ["engine.kv_cache_dtype=fp8_e4m3"],
                 "kv-auto": ["engine.kv_cache_dtype=fp8_e4m3", "engine.kv_cache_scale=auto"],
                 "fp8": ["model.quantization=fp8"]}[setting]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        run_quickstart(model_dir, out, overrides)
        rows = pl.read_parquet(str(out / "*.parquet")).to_dicts()
    return describe(score(rows), len(rows))


if __name__ == "__main__":
    main()
