"""The FP8 KV cache (engine.kv_cache_dtype: fp8_e4m3) on the CPU: the Triton kernels through the
interpreter against the PyTorch references, the triton backend against the torch backend over
prefill, chunked prefill, prefix sharing and decode, the KV budget, and the engine.

Error bound, stated here: the cache holds K and V rounded to e4m3 (3 mantissa bits: within 2^-4
relative, half that on average); attention over such K/V, for a random model's logits, stays within
10% relative error (Frobenius) of the model-dtype cache (measured 4.4% on the llama demo model). Kernels against references
on the same FP8 cache: float32 noise only (1e-4).
"""

from __future__ import annotations

import pytest
import torch

from batchinfer.kernels.interpreter import ensure_interpreter

if not ensure_interpreter():
    pytest.skip("Triton was imported for the GPU in this process; the interpreter tests need their own",
                allow_module_level=True)

from batchinfer.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from batchinfer.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from batchinfer.kernels import cache, decode_attention, decode_launch, extend_attention, reference  # noqa: E402
from paged_batch import PagedSequences, compare_backends_over_steps, make_caches  # noqa: E402

FP8 = torch.float8_e4m3fn
LOGITS_REL = 0.10


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_context(seq_lens, num_kv_heads, head_dim, block_size, seed, scale):
    """FP8 K/V caches holding random values (stored / scale), shuffled block tables, NaN elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seq_lens), max(max(per_seq), 1), dtype=torch.int32)
    for b, (n, s) in enumerate(zip(per_seq, seq_lens)):
        blocks = [perm.pop() for _ in range(n)]
        tables[b, :n] = torch.tensor(blocks, dtype=torch.int32)
        for i in range(s):
            k[blocks[i // block_size], i % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
            v[blocks[i // block_size], i % block_size] = torch.randn(num_kv_heads, head_dim, generator=gen)
    return reference.to_kv_cache(k, FP8, scale), reference.to_kv_cache(v, FP8, scale), tables, gen


@pytest.mark.parametrize("scale", [1.0, 0.01])  # 0.01: values up to ~4 / 0.01 = 400, some saturate at 448
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_is_bit_identical_to_the_reference(scale, dtype):
    gen = torch.Generator().manual_seed(0)
    t, heads, dim, block = 11, 2, 24, 4
    k = (torch.randn(t, heads, dim, generator=gen) * 2).to(dtype)
    v = (torch.randn(t, heads, dim, generator=gen) * 2).to(dtype)
    k[0, 0, :3] = torch.tensor([1e-4, -3e-3, 0.0])  # e4m3 subnormals (scale 1)
    slots = torch.tensor([5, 0, 7, -1, 12, 3, 19, 8, -1, 1, 2], dtype=torch.int64)
    caches = [torch.zeros(6, block, heads, dim, dtype=FP8) for _ in range(4)]
    cache.reshape_and_cache(k, v, caches[0], caches[1], slots, scale, scale)
    reference.reshape_and_cache(k, v, caches[2], caches[3], slots, scale, scale)
    assert torch.equal(_bytes(caches[0]), _bytes(caches[2])) and torch.equal(_bytes(caches[1]), _bytes(caches[3]))
    written = caches[0].view(-1, heads, dim)[slots[slots >= 0]].float()
    want = (k[slots >= 0].float() / scale).clamp(-448, 448)
    assert (written - want).abs().max() <= 448 * 2**-4 and _rel(written, want) < 0.04  # FP8 rounding only
    assert (written.abs() <= 448).all()


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", [(4, 2, 16, 4), (8, 1, 32, 16)])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_kernel_fp8_cache(num_heads, num_kv_heads, head_dim, block_size, num_splits):
    seq_lens = [1, 37, 70, 16]
    scale = 0.02
    k_cache, v_cache, tables, gen = _fp8_context(seq_lens, num_kv_heads, head_dim, block_size, 1, scale)
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, num_splits=num_splits,
                                                  block_n=16, k_scale=scale, v_scale=scale)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, scale, scale)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert want.abs().max() < 10  # the scales were applied (stored values are ~50x the real ones)


@pytest.mark.parametrize("kv_bytes", sorted(decode_launch.KV_TILES))
def test_every_kv_tile_entry_runs_and_matches_the_reference(kv_bytes):
    """Each KV_TILES entry (the decode launch's tile, warps and stages by KV element size), taken by
    default on a cache of that element size: so an entry set from a measurement is covered."""
    tile, warps, stages = decode_launch.KV_TILES[kv_bytes]
    launch = decode_launch.launch_config(64, 32, 8, 128, kv_bytes, 132)
    assert (launch.block_n, launch.num_warps, launch.num_stages) == (decode_launch.decode_block_n(128, tile), warps, stages)
    seq_lens = [1, 150, 300]
    scale = 0.02 if kv_bytes == 1 else 1.0
    k_cache, v_cache, tables, gen = _fp8_context(seq_lens, 2, 16, 16, 2, scale)
    if kv_bytes == 2:  # (float16, not bf16: the interpreter's tl.dot)
        k_cache, v_cache = (reference.from_kv_cache(c, torch.float16, scale) for c in (k_cache, v_cache))
    q = torch.randn(len(seq_lens), 8, 16, generator=gen).to(torch.float16 if kv_bytes == 2 else torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, k_scale=scale, v_scale=scale)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.25, scale, scale)
    tol = dict(rtol=1e-2, atol=1e-3) if kv_bytes == 2 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got.float(), want.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the interpreter's tl.dot is wrong in bf16)
def test_extend_kernel_fp8_cache(dtype):
    # a full prefill, a chunk after a cached prefix, a decode token, a mid-block chunk
    seq_lens, query_lens = [70, 40, 33, 21], [70, 17, 1, 5]
    scale = 0.5
    k_cache, v_cache, tables, gen = _fp8_context(seq_lens, 2, 16, 4, 2, scale)
    q = torch.randn(sum(query_lens), 4, 16, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(query_lens).cumsum(0).tolist(), dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    got = extend_attention.paged_extend_attention(q, k_cache, v_cache, tables, lens, qsl, 70, 0.3, block_rows=32,
                                                  block_n=16, k_scale=scale, v_scale=scale)
    want = reference.paged_attention(q, k_cache, v_cache, tables, lens, qsl, 0.3, scale, scale)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)


def test_triton_backend_matches_torch_backend_fp8_over_steps():
    """Prefill, chunked prefill, a prefix-shared sequence, then decode steps, both backends on FP8
    caches of their own: the same outputs at every step and byte-identical caches at the end."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 16, 4
    scale = 0.25
    tri = TritonAttentionBackend(decode_splits=4, decode_block_n=16, extend_block_rows=16, extend_block_n=16, kv_scale=scale)
    ref = TorchAttentionBackend(kv_scale=scale)
    (kc_t, vc_t), (kc_r, vc_r) = make_caches(2, 40, block_size, num_kv_heads, head_dim, dtype=FP8)
    meta = compare_backends_over_steps(tri, ref, (kc_t, vc_t), (kc_r, vc_r), num_heads, num_kv_heads, head_dim, block_size)
    assert meta.decode_only
    written = torch.isfinite(kc_r.float())
    assert torch.equal(_bytes(kc_t)[written], _bytes(kc_r)[written]) and torch.equal(_bytes(vc_t)[written], _bytes(vc_r)[written])


# --- the model, the budget, the engine -----------------------------------------------------------


def test_model_logits_with_fp8_kv_against_the_model_dtype_cache(model_factory):
    """Chunked prefill then decodes through an FP8 cache (torch backend), against the same steps
    through a float32 cache."""
    from batchinfer.attention import get_attention_backend
    from batchinfer.models.loader import load_model

    path = model_factory("llama")
    logits = []
    for dtype in (torch.float32, FP8):
        model, info = load_model(str(path), "float32", "cpu", get_attention_backend("torch", "cpu"))
        seqs = PagedSequences(64, 4, seed=1)
        caches = make_caches(info.num_layers, 64, 4, info.num_kv_heads, info.head_dim, dtype=dtype)
        prompt = torch.randint(0, info.vocab_size, (30,), generator=torch.Generator().manual_seed(0)).tolist()
        s = seqs.add()
        out = []
        for chunk in (prompt[:12], prompt[12:25], *([t] for t in prompt[25:])):
            ids, positions, meta = seqs.step([(s, chunk)])
            out.append(model.compute_logits(model(ids, positions, caches, meta)))
        logits.append(torch.cat(out))
    rel = _rel(logits[1], logits[0])
    print(f"FP8 KV logits relative error {rel:.4f}")
    assert 0 < rel < LOGITS_REL


def test_kv_budget_counts_one_byte_an_element(model_factory):
    from batchinfer.engine import kv_budget
    from batchinfer.engine.config import EngineConfig
    from batchinfer.models.loader import load_model_info

    path = model_factory("llama")
    info = load_model_info(str(path), "bfloat16", "cpu")
    auto = EngineConfig(model=str(path), kv_cache_gib=0.01, max_num_seqs=10**4)
    fp8 = EngineConfig(model=str(path), kv_cache_gib=0.01, max_num_seqs=10**4, kv_cache_dtype="fp8_e4m3")
    assert kv_budget.kv_cache_dtype(fp8, info) == FP8 and kv_budget.kv_cache_dtype(auto, info) == torch.bfloat16
    budget = kv_budget.kv_cache_bytes(auto, "cpu")
    assert kv_budget.kv_cache_blocks(fp8, info, budget) == 2 * kv_budget.kv_cache_blocks(auto, info, budget)
    assert kv_budget.estimate_activation_bytes(fp8, info) < kv_budget.estimate_activation_bytes(auto, info)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(model=str(path), kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_scale"):
        EngineConfig(model=str(path), kv_cache_dtype="fp8_e4m3", kv_cache_scale=0.0)


def test_engine_with_fp8_kv_cache(model_factory):
    """Greedy runs with a prefix-shared prompt and chunked prefill through the FP8 cache; the cache
    is FP8 and holds four times the blocks of a float32 one in the same memory."""
    from batchinfer.engine import Engine, EngineConfig, Request, SamplingParams

    path = model_factory("qwen3")
    shared = list(range(3, 40))
    reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
            for i, p in enumerate([shared + [50, 51], shared + [60], [5, 9, 13]])]
    blocks = {}
    for kv in ("auto", "fp8_e4m3"):
        cfg = EngineConfig(model=str(path), device="cpu", kv_cache_dtype=kv, kv_cache_gib=0.0005, max_num_batched_tokens=16,
                           max_num_seqs=4)
        with Engine(cfg) as engine:
            runner = engine.runner
            blocks[kv] = runner.num_blocks
            assert runner.kv_caches[0][0].dtype == (FP8 if kv == "fp8_e4m3" else torch.float32)
            results = {r.request_id: r for r in engine.generate(reqs)}
        assert all(r.finish_reason == "length" and len(r.output_token_ids) == 8 for r in results.values())
    assert 4 * blocks["auto"] <= blocks["fp8_e4m3"] < 4 * (blocks["auto"] + 1)  # the same bytes, a quarter a block


def test_job_spec_engine_kv_cache_dtype(tmp_path):
    from batchinfer.job.spec import JobError, load_job

    job = tmp_path / "job.yaml"
    job.write_text("model: m\ninput: {path: in.jsonl, id_column: id}\noutput: {path: out}\nprompt: {template: '{{ text }}'}\n"
                   "engine: {kv_cache_dtype: fp8_e4m3, kv_cache_scale: 2.0}\n")
    cfg = load_job(job).engine_config()
    assert cfg.kv_cache_dtype == "fp8_e4m3" and cfg.kv_cache_scale == 2.0
    job.write_text(job.read_text().replace("fp8_e4m3", "int8"))
    with pytest.raises(JobError, match="kv_cache_dtype"):
        load_job(job)


def test_bench_throughput_fp8_kv_and_weights(tiny_model, tmp_path):
    from batchinfer.bench.report_text import format_report
    from batchinfer.bench.throughput import run_throughput

    r = run_throughput(str(tiny_model), "nano256", {"quantization": "fp8", "kv_cache_dtype": "fp8_e4m3", "kv_cache_scale": "auto"},
                       scale=0.02, cache_dir=tmp_path)
    assert r["errors"] == 0 and r["kv_cache_dtype"] == "fp8_e4m3"
    assert r["kv_scales"] and all(k > 0 and v > 0 for k, v in r["kv_scales"])  # calibrated per layer
    assert "KV scales calibrated" in format_report(r)
    assert r["floor"]["bytes"] == r["floors"]["fp8"]["bytes"]  # everything FP8: the run's floor is the FP8 one
    assert r["floors"]["fp8"]["bytes"] < r["floors"]["bf16"]["bytes"]
    assert "fp8_e4m3 KV cache" in format_report(r)


def test_plan_counts_fp8_kv_bytes(tiny_model, tmp_path):
    import json

    import yaml
    from typer.testing import CliRunner

    from batchinfer.cli import app

    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"doc_id": f"d{i}", "text": f"doc {i}"}) + "\n" for i in range(3)))
    job = {"model": {"path": str(tiny_model), "dtype": "float32", "quantization": "fp8"},
           "input": {"path": "docs.jsonl", "id_column": "doc_id"}, "output": {"path": "out"},
           "prompt": {"template": "Doc: {{ text }}"}, "sampling": {"max_tokens": 3},
           "engine": {"device": "cpu", "kv_cache_gib": 0.001, "kv_cache_dtype": "fp8_e4m3"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    r = CliRunner().invoke(app, ["plan", str(tmp_path / "job.yaml")])
    assert r.exit_code == 0, r.output
    assert "bytes per token (2 layers x 2 kv heads x 32 x 2 x 1 B)" in r.output
    per_block = 16 * 2 * 2 * 2 * 32 * 1
    assert f"the engine's KV cache on cpu: about {(1 << 30) // 1000 // per_block * 16} tokens" in r.output
