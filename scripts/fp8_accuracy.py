"""FP8 accuracy on the real SmolLM2-135M-Instruct, emulated on transformers' float32 model (CPU).

Teacher-forced greedy agreement with float32: 48 chat prompts (the 24 example invoices x the four
questions, cycled), 32 greedy tokens each from transformers' `generate`; then, per variant, the
model's argmax at every answer position against the float32 token there. A variant replaces each
decoder projection's weight by its FP8 rounding (dequantised) and/or fake-quantises its input per
token (e4m3, scale amax/448), which is the math of the engine's dequantised FP8 path.

    python3 scripts/fp8_accuracy.py [--variants act,rtn,rtn-w,gptq,gptq-w,kv,kv-auto] [--held-out]
        [--calibration-rows 44] [--extraction none,kv,kv-auto,fp8,gptq] [--keep PATTERN[,PATTERN]]
        [--sweep layers|kinds]

act: float32 weights, FP8 activations; rtn / rtn-w: weights rounded to nearest with / without FP8
activations; gptq / gptq-w: weights rounded by batchinfer/convert/fp8_gptq.py (calibrated on
examples/data/docs.jsonl with questions; --held-out also calibrates on invoices 0-11 and evaluates
only invoices 12-23). --only PROJ[,PROJ] limits the FP8 activations of `act` to those projections.
kv / kv-auto: float32 weights and activations, the KV cache in FP8 e4m3 (K after rotary and V, divided
by the scale, saturated at +-448, rounded, read back times it: kernels/reference.to_kv_cache), with
engine.kv_cache_scale's fixed 1.0 / its per-layer `auto` scales (engine/kv_calibration.py: amax over
the calibration texts x 2 / 448, measured here on the same model).
--keep PATTERN[,PATTERN][;PATTERN...] leaves the projections it names (models/quant.py module_kept: "o_proj",
"layers.0", a full name, "re:REGEX") in float32, weights and inputs, in every variant; GPTQ then
calibrates the others on that; sets separated by ";" run one after the other (one reference). Each line also prints the share of the decoder's linear FLOPs kept
(for SmolLM2-135M and for the llama-3.1-8b shape). --sweep (after the gptq variants) puts one
decoder layer (layers) or one projection kind (kinds) at a time back to float32 in the GPTQ model,
without calibrating again: a quick ranking of where FP8 costs most.
--extraction runs the quickstart job (jobs/quickstart.yaml: JSON extraction of the 24 invoices,
greedy) through `batchinfer.run` on the float32 engine with each setting (none; kv: an FP8 cache at
scale 1.0; kv-auto: calibrated scales; fp8: FP8 weights rounded at load; gptq: the checkpoint that
`batchinfer quantize-fp8` writes with --keep, of the gptq variant's rounding) and prints each one's exact-match share of
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
    from batchinfer.models.quant import (
        check_keep_patterns,
        dequantize_rows,
        module_kept,
        quantize_rows,
    )

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default="act,rtn,rtn-w,gptq,gptq-w")
    ap.add_argument("--held-out", action="store_true")
    ap.add_argument("--calibration-rows", type=int, default=44)
    ap.add_argument("--extraction", default="", help="quickstart exact match for these settings (none,kv,kv-auto,fp8)")
    ap.add_argument("--only", default=None, help="with act: FP8 inputs only for these projections (e.g. q_proj,k_proj,v_proj)")
    ap.add_argument("--keep", default="", help="projections kept in float32, weights and inputs (e.g. o_proj or layers.0)")
    ap.add_argument("--sweep", choices=("layers", "kinds"), default=None, help="with gptq: one layer / kind at a time back in float32")
    args = ap.parse_args()
    keep_sets = [tuple(p for p in part.split(",") if p) for part in args.keep.split(";")]
    for keep in keep_sets:
        check_keep_patterns(keep, "--keep")
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
    evaluated = [i for i in range(48) if not args.held_out or i % 24 >= 12]
    prompts = [chat(docs[i % 24]["text"], QUESTIONS[(i // 24 + i) % 4]) for i in evaluated]
    with torch.inference_mode():
        answers = [model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):].tolist() for p in prompts]
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n}
    original = {n: m.weight.detach().clone() for n, m in linears.items()}
    print(f"{sum(map(len, answers))} answer positions, {len(linears)} projections", flush=True)
    for keep in keep_sets:
        if keep and not any(module_kept(n, keep) for n in linears):
            raise SystemExit(f"--keep {','.join(keep)}: no decoder projection matches")
    kept: set[str] = set()  # the projections the current --keep set leaves in float32 (the loop below)

    def agreement(activations: bool, only=None, back=frozenset()) -> tuple[int, int]:
        hooks = [m.register_forward_pre_hook(lambda _m, a: (fake_quant_tokens(a[0]),)) for n, m in linears.items()
                 if activations and (only is None or n.rsplit(".", 1)[-1] in only) and n not in kept | back]
        try:
            return teacher_forced(model, prompts, answers)
        finally:
            for h in hooks:
                h.remove()

    def set_weights(fn) -> None:
        for n, m in linears.items():
            m.weight.data = original[n].clone() if n in kept else fn(original[n])

    def rtn(w):  # rounded to nearest, as model.quantization fp8 does at load
        return dequantize_rows(*quantize_rows(w))

    def report(name, result):
        a, t = result
        print(f"{name:55s} {a}/{t} = {100 * a / t:.1f}%", flush=True)

    for keep in keep_sets:
        kept = {n for n in linears if module_kept(n, keep)}
        if keep:
            print(f"--- kept in float32: {len(kept)} projections ({','.join(keep)}); {flops_kept(model.config, keep)}", flush=True)
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
            rounded_fp8 = quantize_fp8_gptq(model, calib, keep=keep)
            print(f"GPTQ on {len(calib)} calibration rows: {time.perf_counter() - t:.0f} s", flush=True)
            if "gptq" in variants:
                report("FP8 weights by GPTQ, FP8 activations", agreement(True))
            if "gptq-w" in variants:
                report("FP8 weights by GPTQ, float32 activations", agreement(False))
            if args.sweep:
                rounded = {n: m.weight.detach().clone() for n, m in linears.items()}
                groups = ([f"layers.{i}" for i in range(model.config.num_hidden_layers)] if args.sweep == "layers"
                          else ["q_proj,k_proj,v_proj", "o_proj", "gate_proj,up_proj", "down_proj"])
                for label in groups:
                    back = frozenset(n for n in linears if module_kept(n, label.split(","))) - kept
                    for n in back:
                        linears[n].weight.data = original[n].clone()
                    both = (*keep, *label.split(","))
                    report(f"GPTQ W8A8, {label} back in float32 ({flops_kept(model.config, both)})", agreement(True, back=back))
                    for n in back:
                        linears[n].weight.data = rounded[n].clone()
        else:
            rounded_fp8 = None
        for setting in [x for x in args.extraction.split(",") if x]:
            print(f"extraction, {setting}: {extraction(path, setting, keep, model, rounded_fp8)}", flush=True)


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


PROJECTION_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                     "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def flops_kept(config, patterns) -> str:
    """The share of the decoder's linear FLOPs in the projections `patterns` keep (module_kept), on
    this model's shapes and on llama-3.1-8b's (hidden 4096, intermediate 14336, 32 q / 8 kv heads of
    128, 32 layers), the same patterns applied to its module names (every layer costs the same, so
    "layers.29" there stands for any one layer)."""
    from batchinfer.models.quant import module_kept

    def share(layers, hidden, inter, heads, kv_heads, head_dim):
        q, kv = heads * head_dim, kv_heads * head_dim
        size = {"q_proj": hidden * q, "k_proj": hidden * kv, "v_proj": hidden * kv, "o_proj": q * hidden,
                "gate_proj": hidden * inter, "up_proj": hidden * inter, "down_proj": inter * hidden}
        kept = sum(size[k] for i in range(layers) for k, parent in PROJECTION_PARENT.items()
                   if module_kept(f"model.layers.{i}.{parent}.{k}", patterns))
        return 100 * kept / (layers * sum(size.values()))

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mine = share(config.num_hidden_layers, config.hidden_size, config.intermediate_size, config.num_attention_heads,
                 config.num_key_value_heads, head_dim)
    return f"{mine:.1f}% of linear FLOPs kept (llama-3.1-8b shape: {share(32, 4096, 14336, 32, 8, 128):.1f}%)"


def extraction(model_dir, setting: str, keep=(), model=None, rounded=None) -> str:
    """The quickstart job's exact-match share with one FP8 setting (module docstring), scored by
    tests/quickstart_score.py as the tests score it."""
    import sys
    import tempfile

    import polars as pl

    sys.path.insert(0, str(ROOT / "tests"))
    from quickstart_score import describe, run_quickstart, score

    overrides = {"none": [], "kv": ["engine.kv_cache_dtype=fp8_e4m3"],
                 "kv-auto": ["engine.kv_cache_dtype=fp8_e4m3", "engine.kv_cache_scale=auto"],
                 "fp8": ["model.quantization=fp8", *([f"model.fp8_keep=[{','.join(keep)}]"] if keep else [])],
                 "gptq": []}[setting]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        if setting == "gptq":  # the FP8 checkpoint the converter writes (of the gptq variant's rounding), run as stored
            from batchinfer.convert.fp8_gptq import kept_projections, write_checkpoint

            if rounded is None:
                raise SystemExit("--extraction gptq needs the gptq variant (--variants gptq)")
            write_checkpoint(Path(model_dir), Path(tmp) / "fp8", model, rounded, kept_projections(model, keep))
            model_dir = Path(tmp) / "fp8"
        run_quickstart(model_dir, out, overrides)
        rows = pl.read_parquet(str(out / "*.parquet")).to_dicts()
    return describe(score(rows), len(rows))


if __name__ == "__main__":
    main()
