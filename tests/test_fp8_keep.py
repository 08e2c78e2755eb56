"""FP8 with some projections kept in 16-bit (model.fp8_keep; a checkpoint's quantization_config
ignore list; `batchinfer quantize-fp8 --keep`), on tiny random models on the CPU (dequantised path).

The kept projections are plain Linear modules holding the checkpoint's weights unchanged, the others
Fp8Linear; the model computes exactly the FP8 math emulated by hand on every projection but the
kept ones (the bound of tests/test_fp8.py, EMULATED_REL)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from paged_batch import PagedSequences, make_caches
from typer.testing import CliRunner

from batchinfer.attention import get_attention_backend
from batchinfer.models.linear import Fp8Linear, Linear
from batchinfer.models.loader import ModelLoadError, load_model, load_model_info
from batchinfer.models.quant import (
    check_keep_patterns,
    checkpoint_keep,
    dequantize_rows,
    module_kept,
    quantize_rows,
    quantize_tokens,
)

EMULATED_REL = 1e-3


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _load(path, **kw):
    return load_model(str(path), "float32", "cpu", get_attention_backend("torch", "cpu"), **kw)


def _logits(model, info, prompts):
    seqs = PagedSequences(64, 4, seed=1)
    caches = make_caches(info.num_layers, 64, 4, info.num_kv_heads, info.head_dim)
    ids, positions, meta = seqs.step([(seqs.add(), p) for p in prompts])
    return model.compute_logits(model(ids, positions, caches, meta))


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in (5, 11, 18)]


def _kinds(model) -> dict[tuple[int, str], type]:
    """(layer, fused projection) -> its class."""
    return {(i, name): type(getattr(block, name)) for i, layer in enumerate(model.layers)
            for block, names in ((layer.self_attn, ("qkv_proj", "o_proj")), (layer.mlp, ("gate_up_proj", "down_proj")))
            for name in names}


# --- the matching rule ---------------------------------------------------------------------------


def test_module_kept_matches_dotted_parts_and_regexes():
    name = "model.layers.12.self_attn.o_proj"
    assert module_kept(name, ["o_proj"]) and module_kept(name, ["layers.12"]) and module_kept(name, [name])
    assert module_kept(name, ["self_attn"]) and module_kept(name, [r"re:.*\.(o|q)_proj$"])
    assert not module_kept(name, ["layers.1"]) and not module_kept(name, ["proj"]) and not module_kept(name, ["lm_head"])
    assert not module_kept(name, [r"re:layers\.12"])  # from the start of the name, as compressed-tensors matches
    assert not module_kept(name, [])
    for bad, words in [("", "not a module name"), ("re:", "not a module name"), ("re:(", "not a valid regular expression")]:
        with pytest.raises(ValueError, match=f"fp8_keep: .*{words}"):
            check_keep_patterns([bad], "fp8_keep")


def test_checkpoint_keep_reads_the_hub_lists():
    ct = {"quantization_config": {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*layers\\.0\\..*"]}}
    assert checkpoint_keep(ct) == ("lm_head", "re:.*layers\\.0\\..*")
    fp8 = {"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": ["lm_head", "model.layers.1.mlp"],
                                   "ignored_layers": ["model.layers.1.mlp", "o_proj"]}}
    assert checkpoint_keep(fp8) == ("lm_head", "model.layers.1.mlp", "o_proj")
    assert checkpoint_keep({}) == () and checkpoint_keep({"quantization_config": {"quant_method": "fp8"}}) == ()
    with pytest.raises(ValueError, match="quantization_config.ignore must be a list"):
        checkpoint_keep({"quantization_config": {"quant_method": "compressed-tensors", "ignore": "lm_head"}})


# --- model.fp8_keep at load ----------------------------------------------------------------------


def test_kept_projections_stay_float_and_the_rest_is_fp8(model_factory):
    path = model_factory("llama")
    model, info = _load(path, quantization="fp8", fp8_keep=("o_proj", "layers.1.mlp"))
    kinds = _kinds(model)
    assert {k for k, c in kinds.items() if c is Linear} == {(0, "o_proj"), (1, "o_proj"), (1, "gate_up_proj"), (1, "down_proj")}
    assert all(c is Fp8Linear for k, c in kinds.items() if k not in {(0, "o_proj"), (1, "o_proj"), (1, "gate_up_proj"), (1, "down_proj")})
    assert info.fp8_kept == ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj",
                             "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj")
    # the kept weights are the checkpoint's, unrounded
    plain, _ = _load(path)
    assert torch.equal(model.layers[0].self_attn.o_proj.weight, plain.layers[0].self_attn.o_proj.weight)
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, plain.layers[1].mlp.gate_up_proj.weight)
    assert info.fp8_kept_params == sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    # memory: what the modules hold, FP8 where FP8
    held = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    assert info.weight_bytes == held == load_model_info(str(path), "float32", "cpu", "fp8", ("o_proj", "layers.1.mlp")).weight_bytes
    # the logits: the FP8 math emulated on every projection but the kept ones
    prompts = _prompts(info.vocab_size)
    got = _logits(model, info, prompts)

    def fake_quant(_module, args):
        xq, xs = quantize_tokens(args[0])
        return ((xq.float() * xs).to(args[0].dtype),)

    with torch.inference_mode():
        for (i, name), cls in kinds.items():
            if cls is Fp8Linear:
                block = plain.layers[i].self_attn if name in ("qkv_proj", "o_proj") else plain.layers[i].mlp
                m = getattr(block, name)
                m.weight.copy_(dequantize_rows(*quantize_rows(m.weight)))
                m.register_forward_pre_hook(fake_quant)
    assert _rel(got, _logits(plain, info, prompts)) < EMULATED_REL


def test_fp8_keep_errors_name_the_field(model_factory):
    path = model_factory("llama")
    with pytest.raises(ModelLoadError, match=r"q_proj.*but not.*k_proj.*fused projection \(qkv_proj\)"):
        load_model_info(str(path), quantization="fp8", fp8_keep=("q_proj",))
    with pytest.raises(ModelLoadError, match="model.fp8_keep 'layers.7' matches no decoder projection"):
        load_model_info(str(path), quantization="fp8", fp8_keep=("layers.7",))
    with pytest.raises(ModelLoadError, match="model.fp8_keep: 're:\\[' is not a valid regular expression"):
        load_model_info(str(path), quantization="fp8", fp8_keep=("re:[",))
    # q, k and v together are one kept fused projection
    info = load_model_info(str(path), quantization="fp8",
                           fp8_keep=("layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", r"re:model\.layers\.0\.self_attn\.v"))
    assert info.fp8_kept == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")
    with pytest.raises(ModelLoadError, match=r"k_proj, .*v_proj kept in 16-bit but not model.layers.1.self_attn.q_proj"):
        load_model_info(str(path), quantization="fp8", fp8_keep=("layers.0.self_attn.q_proj", "k_proj", "v_proj"))


def test_step_cost_runs_kept_projections_at_the_16_bit_rate(model_factory):
    from batchinfer.bench.roofline import Ceilings
    from batchinfer.engine.step_cost import StepCost

    path = model_factory("llama")
    ceil = Ceilings("x", copy_bytes_per_s=1e9, matmul_flops_per_s=1e12, fp8_matmul_flops_per_s=2e12)
    all_fp8 = StepCost.for_model(load_model_info(str(path), quantization="fp8"), ceil, 2)
    info = load_model_info(str(path), quantization="fp8", fp8_keep=("layers.0",))
    kept = StepCost.for_model(info, ceil, 2)
    assert all_fp8.layer_flops_per_s == 2e12
    share = info.fp8_kept_params / info.num_layer_params
    assert 0.3 < share < 0.5  # one of two layers, less its norms
    assert kept.layer_flops_per_s == pytest.approx(1 / ((1 - share) / 2e12 + share / 1e12))


def test_engine_config_and_job_field(tmp_path):
    from batchinfer.engine.config import EngineConfig
    from batchinfer.job.spec import JobError, load_job

    assert EngineConfig(model="m", quantization="fp8", fp8_keep=["o_proj"]).fp8_keep == ("o_proj",)
    with pytest.raises(ValueError, match="fp8_keep .*quantization is none"):
        EngineConfig(model="m", fp8_keep=("o_proj",))
    with pytest.raises(ValueError, match="fp8_keep must be a list"):
        EngineConfig(model="m", quantization="fp8", fp8_keep="o_proj")
    with pytest.raises(ValueError, match="fp8_keep: 're:\\(' is not a valid regular expression"):
        EngineConfig(model="m", quantization="fp8", fp8_keep=("re:(",))
    job = tmp_path / "job.yaml"
    job.write_text("model: {path: m, quantization: fp8, fp8_keep: [o_proj, layers.0]}\ninput: {path: in.jsonl, id_column: id}\n"
                   "output: {path: out}\nprompt: {template: '{{ text }}'}\n")
    assert load_job(job).engine_config().fp8_keep == ("o_proj", "layers.0")
    assert load_job(job, ["model.fp8_keep=[down_proj]"]).engine_config().fp8_keep == ("down_proj",)
    with pytest.raises(JobError, match="fp8_keep"):
        load_job(job, ["model.quantization=none"])


def test_engine_greedy_with_kept_projections(model_factory):
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

    path = model_factory("qwen3")
    reqs = [Request("r0", [5, 9, 13, 21], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))]
    with Engine(EngineConfig(model=str(path), device="cpu", quantization="fp8", fp8_keep=("layers.0",), num_kv_blocks=64)) as engine:
        assert len(engine.model_info.fp8_kept) == 7 and engine.model_info.quantization == "fp8"
        (result,) = engine.generate(reqs)
    assert len(result.output_token_ids) == 6


# --- checkpoints that keep modules unquantised -----------------------------------------------------


def _calibration(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(3)]


def test_converter_records_kept_modules_and_the_engine_loads_them_float(model_factory, tmp_path):
    from safetensors.torch import load_file

    from batchinfer.convert.fp8_gptq import quantize_checkpoint

    src = model_factory("llama")
    vocab = json.loads((src / "config.json").read_text())["vocab_size"]
    report = quantize_checkpoint(src, tmp_path / "fp8", _calibration(vocab), keep=("layers.1.mlp", "o_proj"))
    assert report.kept == 5 and report.projections == 14 - 5
    kept = ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.mlp.gate_proj",
            "model.layers.1.mlp.up_proj", "model.layers.1.mlp.down_proj"]
    qc = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and sorted(qc["ignore"]) == sorted(["lm_head", *kept])
    stored, original = load_file(str(tmp_path / "fp8" / "model.safetensors")), load_file(str(next(src.glob("*.safetensors"))))
    for name in kept:
        assert torch.equal(stored[f"{name}.weight"], original[f"{name}.weight"]) and f"{name}.weight_scale" not in stored
    assert stored["model.layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    # quantization none: the checkpoint runs as stored, its ignore list in float
    model, info = _load(tmp_path / "fp8")
    assert info.quantization == "fp8" and tuple(sorted(info.fp8_kept)) == tuple(sorted(kept))
    kinds = _kinds(model)
    assert {k for k, c in kinds.items() if c is Linear} == {(0, "o_proj"), (1, "o_proj"), (1, "gate_up_proj"), (1, "down_proj")}
    plain, _ = _load(src)
    assert torch.equal(model.layers[1].mlp.down_proj.weight, plain.layers[1].mlp.down_proj.weight)
    # the same checkpoint as quant_method fp8 with modules_to_not_convert loads the same way
    cfg = json.loads((tmp_path / "fp8" / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": ["lm_head", *kept]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    again, _ = _load(tmp_path / "fp8")
    assert _kinds(again) == kinds
    # an ignore list that misses a module stored in 16-bit: quantised at load; one naming an FP8 tensor: refused
    cfg["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.1.mlp", "model.layers.0.mlp.down_proj"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="down_proj.weight is FP8 but .*keeps it in 16-bit"):
        _load(tmp_path / "fp8")


def test_cli_keep(model_factory, tmp_path):
    from batchinfer.cli import app

    src = model_factory("llama")
    rows = tmp_path / "cal.jsonl"
    rows.write_text("\n".join(json.dumps({"text": f"calibration row {i}"}) for i in range(3)) + "\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["quantize-fp8", str(src), str(tmp_path / "out"), "--calibration", str(rows), "--no-chat",
                             "--keep", "layers.0.mlp.down_proj, layers.1.mlp.down_proj"])
    assert ok.exit_code == 0, ok.output
    assert "12 projections of 2 layers in FP8, 2 kept in 16-bit" in ok.output
    qc = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    for keep, words in [("layers.9", "matches no decoder projection"), ("re:(", "not a valid regular expression")]:
        r = runner.invoke(app, ["quantize-fp8", str(src), str(tmp_path / f"o{len(keep)}"), "--calibration", str(rows), "--keep", keep])
        assert r.exit_code == 2 and words in r.output, r.output
