"""FP8 weights (model.quantization: fp8) on the CPU: the dequantised path, the same math the GPU's
torch._scaled_mm path computes (tests/test_fp8_gpu.py compares the two on a GPU).

Error bounds, stated once here and derived from e4m3's 3 mantissa bits (a value is rounded to within
2^-4 of itself, relative; the largest of a row, near 448, to within 16/448 of the row's amax):
- quantise/dequantise: every element within 16/448 = 3.6% of its row's amax; relative RMS error of a
  Gaussian matrix under 3%;
- one Fp8Linear (weights and activations both FP8) against the float product: relative error under 5%;
- a random-weight model's logits with FP8 projections against the same model unquantised: relative
  error (Frobenius) under 20% (measured 8-11% over the families; random logits are flat, so token
  agreement means nothing there), and against the float model with the FP8 rounding emulated by hand
  (weights dequantised, activations fake-quantised per token): under 1e-3, i.e. the engine's FP8
  path is exactly that math.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.attention import get_attention_backend
from batchinfer.models.linear import Fp8Linear, Linear
from batchinfer.models.loader import ModelLoadError, load_model, load_model_info
from batchinfer.models.quant import FP8_DTYPE, FP8_MAX, dequantize_rows, quantize_rows, quantize_tokens
from paged_batch import PagedSequences, make_caches

ROW_BOUND = 16 / 448  # half an ulp at the top of e4m3's range, relative to the row's amax
LINEAR_REL = 0.05
MODEL_REL = 0.20
EMULATED_REL = 1e-3
LENGTHS = (5, 11, 18)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# --- numerics ------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 9), cols=st.integers(1, 70), log_scale=st.floats(-12, 6), seed=st.integers(0, 2**16))
def test_round_trip_within_half_ulp_of_row_amax(rows, cols, log_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=gen) * (2.0**log_scale)
    q, scale = quantize_rows(w)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.shape == (rows,)
    assert torch.allclose(scale, w.abs().amax(1) / FP8_MAX, rtol=1e-6)
    assert q.float().abs().amax(1).sub(FP8_MAX).abs().max() < 1e-3  # each row's largest value maps to 448
    err = (dequantize_rows(q, scale) - w).abs()
    assert (err <= ROW_BOUND * w.abs().amax(1, keepdim=True) * (1 + 1e-6)).all()


def test_round_trip_relative_error_of_a_gaussian_matrix():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 0.02
    q, scale = quantize_rows(w)
    rel = _rel(dequantize_rows(q, scale), w)
    assert 0.005 < rel < 0.03  # not zero: the values really are rounded to 3 mantissa bits


def test_zero_rows_and_exact_values():
    w = torch.zeros(3, 16)
    w[1, :4] = torch.tensor([448.0, -224.0, 1.0, 0.5])
    q, scale = quantize_rows(w)
    assert torch.equal(dequantize_rows(q, scale), w)  # zeros stay zeros; representable values are exact
    xq, xs = quantize_tokens(w)
    assert xs.shape == (3, 1) and torch.equal(xq.float() * xs, w)


@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_against_the_float_product(bias):
    gen = torch.Generator().manual_seed(1)
    n, k = 96, 160
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    layer = Fp8Linear(k, n, bias, torch.float32)
    assert layer.matmul == "dequant"  # the CPU path
    layer.load_rows(0, w[:40])  # in two row ranges, as q/k/v are loaded into a fused qkv
    layer.load_rows(40, w[40:])
    if bias:
        layer.bias.copy_(b)
    x = torch.randn(37, k, generator=gen)
    ref = torch.nn.functional.linear(x, w, b)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert 1e-3 < _rel(y, ref) < LINEAR_REL
    # exactly the scaled product of the FP8 values: (x_fp8 @ w_fp8^T) * x_scale * w_scale (+ b)
    xq, xs = quantize_tokens(x)
    exact = (xq.double() @ layer.weight.double().t()) * xs.double() * layer.weight_scale.double()
    exact = exact + b.double() if bias else exact
    assert _rel(y, exact) < 1e-5


def test_fp8_linear_in_bfloat16_on_the_cpu():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 48, generator=gen) * 0.05
    layer = Fp8Linear(48, 64, False, torch.bfloat16)
    layer.load_rows(0, w)
    x = torch.randn(5, 48, generator=gen).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16 and _rel(y, x.float() @ w.t()) < LINEAR_REL


# --- a model with FP8 projections ------------------------------------------------------------------


def _logits(model, info, prompts):
    seqs = PagedSequences(64, 4, seed=1)
    caches = make_caches(info.num_layers, 64, 4, info.num_kv_heads, info.head_dim)
    ids, positions, meta = seqs.step([(seqs.add(), p) for p in prompts])
    return model.compute_logits(model(ids, positions, caches, meta))


def _prompts(info):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, info.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS]


def _emulate_fp8(model) -> None:
    """Turn a float model into the FP8 math by hand: every projection's weight replaced by its
    dequantised FP8 rows, and its input fake-quantised per token (a forward pre-hook)."""

    def fake_quant(_module, args):
        xq, xs = quantize_tokens(args[0])
        return ((xq.float() * xs).to(args[0].dtype),)

    for module in model.modules():
        if isinstance(module, Linear):
            q, s = quantize_rows(module.weight)
            module.weight.copy_(dequantize_rows(q, s, module.weight.dtype))
            module.register_forward_pre_hook(fake_quant)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_model_logits_fp8_against_float(family, model_factory):
    path = model_factory(family)
    backend = get_attention_backend("torch", "cpu")
    fp8, info = load_model(str(path), "float32", "cpu", backend, quantization="fp8")
    assert info.quantization == "fp8"
    projections = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(projections) == 4 * info.num_layers and not any(isinstance(m, Linear) for m in fp8.modules())
    assert fp8.embed_tokens.dtype == torch.float32 and fp8.lm_head.dtype == torch.float32  # never quantised
    plain, _ = load_model(str(path), "float32", "cpu", backend)
    prompts = _prompts(info)
    got, ref = _logits(fp8, info, prompts), _logits(plain, info, prompts)
    assert 1e-3 < _rel(got, ref) < MODEL_REL
    with torch.inference_mode():
        _emulate_fp8(plain)
    assert _rel(got, _logits(plain, info, prompts)) < EMULATED_REL


def test_weight_bytes_count_fp8_projections(model_factory):
    path = model_factory("llama")
    plain = load_model_info(str(path), "bfloat16", "cpu")
    fp8 = load_model_info(str(path), "bfloat16", "cpu", quantization="fp8")
    assert plain.weight_bytes == plain.num_params * 2
    model, info = load_model(str(path), "bfloat16", "cpu", get_attention_backend("torch", "cpu"), quantization="fp8")
    held = sum(t.numel() * t.element_size() for t in {id(p): p for p in model.parameters()}.values())
    assert info.weight_bytes == fp8.weight_bytes == held
    proj = sum(m.weight.numel() for m in model.modules() if isinstance(m, Fp8Linear))
    assert plain.weight_bytes - fp8.weight_bytes == proj - 4 * sum(m.weight_scale.numel() for m in model.modules()
                                                                   if isinstance(m, Fp8Linear))


def test_kv_budget_plan_counts_fp8_weights(model_factory):
    """`plan`'s KV estimate on a GPU subtracts the weights still to load: FP8 projections leave more."""
    from batchinfer.engine import kv_budget
    from batchinfer.engine.config import EngineConfig

    path = model_factory("llama")
    cfg = EngineConfig(model=str(path), quantization="fp8")
    plain = load_model_info(str(path), "bfloat16", "cpu")
    fp8 = load_model_info(str(path), "bfloat16", "cpu", quantization="fp8")
    free = 10 * plain.weight_bytes
    budgets = [kv_budget.kv_cache_bytes(cfg, "cuda", free_bytes=free, unloaded_weight_bytes=i.weight_bytes) for i in (plain, fp8)]
    assert budgets[1] - budgets[0] == int((plain.weight_bytes - fp8.weight_bytes) * cfg.kv_cache_memory_fraction) or \
        abs(budgets[1] - budgets[0] - (plain.weight_bytes - fp8.weight_bytes) * cfg.kv_cache_memory_fraction) <= 1


# --- checkpoints already in FP8 --------------------------------------------------------------------

PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")


def _write_fp8_checkpoint(src, dst, *, per_tensor: bool = False, compressed: bool = False, input_scale: bool = True):
    """An HF-format FP8 checkpoint of the float model at src: every projection's weight float8_e4m3fn
    with its weight_scale (per channel [N, 1], or per tensor []), an input_scale, and config.json's
    quantization_config (quant_method fp8, or compressed-tensors float8)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {}
    for path in sorted(dst.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
        path.unlink()
    out = {}
    for name, t in tensors.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and base.endswith(PROJ):
            if per_tensor:
                scale = (t.float().abs().amax() / FP8_MAX).reshape(())
                q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            else:
                q, s = quantize_rows(t)
                scale = s.reshape(-1, 1)
            out[name], out[f"{base}.weight_scale"] = q.contiguous(), scale.contiguous()
            if input_scale:
                out[f"{base}.input_scale"] = torch.tensor(0.01)
        else:
            out[name] = t.contiguous()
    save_file(out, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    if compressed:
        strategy = "tensor" if per_tensor else "channel"
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": strategy},
                                          "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
            "ignore": ["lm_head"],
        }
    else:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static" if input_scale else "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("compressed", [False, True], ids=["fp8", "compressed-tensors"])
def test_fp8_checkpoint_loads_as_stored(compressed, model_factory, tmp_path):
    src = model_factory("qwen2")  # q/k/v biases stay float
    ckpt = _write_fp8_checkpoint(src, tmp_path / "fp8", compressed=compressed)
    backend = get_attention_backend("torch", "cpu")
    stored, info = load_model(str(ckpt), "float32", "cpu", backend)  # quantization none: an FP8 checkpoint runs as stored
    assert info.quantization == "fp8" and load_model_info(str(ckpt)).quantization == "fp8"
    at_load, _ = load_model(str(src), "float32", "cpu", backend, quantization="fp8")
    prompts = _prompts(info)
    for a, b in zip(stored.modules(), at_load.modules()):
        if isinstance(a, Fp8Linear):
            assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
            assert torch.equal(a.weight_scale, b.weight_scale)
    assert torch.equal(_logits(stored, info, prompts), _logits(at_load, info, prompts))


@pytest.mark.parametrize("compressed", [False, True], ids=["fp8", "compressed-tensors"])
def test_fp8_checkpoint_with_per_tensor_scales(compressed, model_factory, tmp_path):
    from safetensors.torch import load_file

    src = model_factory("llama")
    ckpt = _write_fp8_checkpoint(src, tmp_path / "fp8", per_tensor=True, compressed=compressed, input_scale=False)
    stored = load_file(str(ckpt / "model.safetensors"))
    model, info = load_model(str(ckpt), "float32", "cpu", get_attention_backend("torch", "cpu"))
    qkv = model.layers[1].self_attn.qkv_proj
    want = torch.cat([dequantize_rows(stored[f"model.layers.1.self_attn.{n}.weight"], stored[f"model.layers.1.self_attn.{n}.weight_scale"])
                      for n in ("q_proj", "k_proj", "v_proj")])
    assert torch.equal(dequantize_rows(qkv.weight, qkv.weight_scale), want)  # each tensor's scale over its own rows
    plain, _ = load_model(str(src), "float32", "cpu", get_attention_backend("torch", "cpu"))
    prompts = _prompts(info)
    assert _rel(_logits(model, info, prompts), _logits(plain, info, prompts)) < MODEL_REL


def test_fp8_checkpoint_errors_name_the_field(model_factory, tmp_path):
    src = model_factory("llama")
    ckpt = _write_fp8_checkpoint(src, tmp_path / "fp8")

    def with_qc(**qc):
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["quantization_config"] = qc
        (ckpt / "config.json").write_text(json.dumps(cfg))

    for qc, words in [
        ({"quant_method": "gptq", "bits": 4}, "quantization_config.quant_method 'gptq'"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "quantization_config.weight_block_size"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "quantization_config.format"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}, "weights.strategy"),
    ]:
        with_qc(**qc)
        with pytest.raises(ModelLoadError, match=words.replace("[", r"\[")):
            load_model_info(str(ckpt))
    with pytest.raises(ModelLoadError, match="model.quantization"):
        load_model_info(str(src), quantization="int4")


def test_fp8_checkpoint_missing_scale(model_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    ckpt = _write_fp8_checkpoint(model_factory("llama"), tmp_path / "fp8")
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.weight_scale"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"without their scale.*model\.layers\.0\.mlp\.down_proj\.weight_scale"):
        load_model(str(ckpt), "float32", "cpu", get_attention_backend("torch", "cpu"))


def test_fp8_weights_without_quantization_config(model_factory, tmp_path):
    ckpt = _write_fp8_checkpoint(model_factory("llama"), tmp_path / "fp8")
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="is FP8 but config.json has no FP8 quantization_config"):
        load_model(str(ckpt), "float32", "cpu", get_attention_backend("torch", "cpu"))


# --- the job field and the engine ------------------------------------------------------------------


def test_job_spec_model_quantization(tmp_path):
    from batchinfer.job.spec import JobError, load_job

    job = tmp_path / "job.yaml"
    job.write_text("model: {path: m, quantization: fp8}\ninput: {path: in.jsonl, id_column: id}\noutput: {path: out}\n"
                   "prompt: {template: '{{ text }}'}\n")
    spec = load_job(job)
    assert spec.model.quantization == "fp8" and spec.engine_config().quantization == "fp8"
    job.write_text(job.read_text().replace("fp8", "int4"))
    with pytest.raises(JobError, match="model.quantization"):
        load_job(job)


def test_engine_greedy_with_fp8_weights(model_factory):
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

    path = model_factory("qwen3")
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            for i, p in enumerate([[5, 9, 13, 21], list(range(3, 40))])]
    with Engine(EngineConfig(model=str(path), device="cpu", quantization="fp8", num_kv_blocks=64)) as engine:
        assert engine.model_info.quantization == "fp8"
        results = {r.request_id: r for r in engine.generate(reqs)}
    assert all(r.finish_reason == "length" and len(r.output_token_ids) == 8 for r in results.values())


# --- bench throughput --quantization fp8 -----------------------------------------------------------


def test_floor_with_fp8_projections_by_hand():
    from batchinfer.bench.roofline import Ceilings, workload_floor

    ceil = Ceilings("x", copy_bytes_per_s=1e9, matmul_flops_per_s=1e12, fp8_matmul_flops_per_s=2e12)
    kw = dict(num_layers=2, hidden_size=8, num_heads=2, num_kv_heads=1, head_dim=4, vocab_size=16, layer_params=1000,
              dtype_bytes=2, kv_capacity_tokens=10**6, ceilings=ceil)
    bf16 = workload_floor([10], [5], weight_bytes=4000, **kw)
    fp8 = workload_floor([10], [5], weight_bytes=2000, layer_flops_per_s=2e12, **kw)
    layer = 2 * 1000 * 15
    other = 2 * 16 * 8 * (1 + 5) + 4 * 2 * 2 * 4 * (55 + (5 * 10 + 10))
    assert bf16.compute_s == pytest.approx((layer + other) / 1e12)
    assert fp8.compute_s == pytest.approx(layer / 2e12 + other / 1e12)
    assert bf16.bytes - fp8.bytes == 5 * 2000  # five decode steps read the weights, FP8 half the bytes


def test_bench_throughput_fp8_reports_both_floors(tiny_model, tmp_path):
    from batchinfer.bench.report_text import format_report
    from batchinfer.bench.throughput import run_throughput

    r = run_throughput(str(tiny_model), "nano256", {"quantization": "fp8"}, scale=0.02, cache_dir=tmp_path)
    assert r["errors"] == 0 and r["quantization"] == "fp8" and r["engine"]["quantization"] == "fp8"
    floors = r["floors"]  # the run's own floor: FP8 weights, float32 KV; between all-16-bit and all-FP8
    assert floors["fp8"]["bytes"] < r["floor"]["bytes"] < floors["bf16"]["bytes"]
    assert r["ceilings"]["fp8_matmul_TFLOPs"] is None  # no FP8 tensor cores on the CPU: the FP8 floor uses the 16-bit rate
    text = format_report(r)
    assert "fp8 weights" in text and "vs 16-bit floor" in text and "vs FP8 floor" in text


# --- the per-token quantisation kernel (Triton interpreter on the CPU) ------------------------------


def _e4m3_grid_and_midpoints() -> torch.Tensor:
    """Every finite e4m3 value, every midpoint between neighbours and the floats either side of it."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    values = torch.sort(values[~values.isnan()].unique()).values
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.full_like(mids, 1e9), torch.full_like(mids, -1e9)
    return torch.cat([values, mids, torch.nextafter(mids, up), torch.nextafter(mids, down)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_kernel_is_bit_identical_to_the_reference(dtype):
    pytest.importorskip("triton")
    from batchinfer.kernels.fp8_quant import quantize_fp8_tokens
    from batchinfer.kernels.reference import quantize_fp8_tokens as reference

    grid = _e4m3_grid_and_midpoints()
    rows = [torch.cat([grid, torch.tensor([448.0])])]  # scale exactly 1: every tie and its neighbours
    gen = torch.Generator().manual_seed(3)
    rows += [torch.randn(rows[0].numel(), generator=gen) * 10.0**e for e in (-6, -2, 0, 3)]
    x = torch.stack(rows)
    x[2, :50] = 0.0
    x[3, :200] *= 1e-5  # values that land in e4m3's subnormals
    x = torch.cat([x, torch.zeros(1, x.shape[1])]).to(dtype)
    q, scale = quantize_fp8_tokens(x, block=256)  # several tiles a row, the last one partial
    want_q, want_scale = reference(x)
    assert torch.equal(scale, want_scale) and scale.shape == (x.shape[0], 1)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@settings(max_examples=15, deadline=None)
@given(t=st.integers(1, 6), k=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_quant_kernel_shapes(t, k, seed):
    pytest.importorskip("triton")
    from batchinfer.kernels.fp8_quant import quantize_fp8_tokens
    from batchinfer.kernels.reference import quantize_fp8_tokens as reference

    x = torch.randn(t, k, generator=torch.Generator().manual_seed(seed)).bfloat16()
    q, scale = quantize_fp8_tokens(x, block=64)
    want_q, want_scale = reference(x)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
