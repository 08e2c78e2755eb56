"""The fused sampling kernel against engine/sampler.py's torch path.

CPU: the kernel runs under the Triton interpreter (small shapes: it is slow) and must give the
same uniform noise bit for bit, the same Gumbel noise up to the last ulp of numpy's log, and the
same tokens. sm_90: the kernels compile (libdevice log, IEEE division). GPU (pytest -m gpu): the
noise is bit-identical to torch's CUDA path, the tokens are identical at B=256, V=151936, the
launch never syncs and replays in a CUDA graph; the time per call is printed.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.kernels.interpreter import ensure_interpreter

# Before anything imports triton: interpreted on a CPU-only machine, compiled on a GPU machine.
INTERPRETED = ensure_interpreter()

import batchinfer.kernels.sampling as K  # noqa: E402
from batchinfer.engine.request import SamplingParams  # noqa: E402
from batchinfer.engine.sampler import (  # noqa: E402
    gumbel_noise,
    make_sampling_batch,
    sample,
    uniform_noise,
    uses_fused_kernel,
)

interpreted = pytest.mark.skipif(
    not INTERPRETED,
    reason="Triton was imported for the GPU in this process; the interpreter tests run on a CPU-only machine",
)


def kernel_draw(logits: torch.Tensor, params: list[SamplingParams], seeds, steps, **kw) -> torch.Tensor:
    b = make_sampling_batch(params, seeds, steps, logits.device)
    return K.fused_sample(logits, b.temperature, b.seeds, b.steps, b.greedy, **kw)


def torch_draw(logits: torch.Tensor, params: list[SamplingParams], seeds, steps) -> torch.Tensor:
    return sample(logits, make_sampling_batch(params, seeds, steps, logits.device), fused=False)


EDGE_SEEDS = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0x9E3779B9])
EDGE_STEPS = torch.tensor([0, 2**32 - 1, 1, 17, 123456789, 2**31])


# ---------------------------------------------------------------- noise


@interpreted
def test_uniform_noise_is_bit_identical():
    ids = torch.cat([torch.arange(3000), torch.tensor([151935, 151936, 2**24 + 3, 2**31 - 2])])
    u, g = K.kernel_noise(EDGE_SEEDS, EDGE_STEPS, ids)
    assert torch.equal(u, uniform_noise(EDGE_SEEDS, EDGE_STEPS, ids))
    # numpy's float32 log (the interpreter) and torch's CPU log may round differently in the last
    # place; on CUDA both call logf and the GPU test asserts equality.
    expected = gumbel_noise(EDGE_SEEDS, EDGE_STEPS, ids)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, expected, rtol=2e-6, atol=5e-7)


@interpreted
def test_noise_depends_on_every_key():
    ids = torch.arange(256)
    u, _ = K.kernel_noise(torch.tensor([5, 5, 6]), torch.tensor([9, 10, 9]), ids)
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert len(set(u[0].tolist())) == 256  # distinct per token id


# ---------------------------------------------------------------- tokens

MIXED = [
    SamplingParams(),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.7),
]


@interpreted
@pytest.mark.parametrize("splits,block", [(None, 128), (1, 128), (3, 64), (1, 1024)])
def test_tokens_equal_torch_path(splits, block):
    """B=5, V=1000: greedy and sampled rows, banned tokens, a fully banned row, greedy ties."""
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 1000, generator=gen) * 3
    logits[0, 1::2] = -math.inf  # half the vocabulary banned
    logits[1, [17, 600]] = 40.0  # greedy tie: lowest id
    logits[2] = -math.inf  # a fully banned sampled row: torch picks id 0
    logits[3, :900] = -math.inf  # greedy row whose only candidates sit at the end
    seeds, steps = [1, 2, 3, 4, 2**40 + 9], [10, 20, 30, 40, 50]
    expected = torch_draw(logits, MIXED, seeds, steps)
    out = kernel_draw(logits, MIXED, seeds, steps, splits=splits, block=block)
    assert out.dtype == torch.int64 and out.shape == (5,)
    assert out.tolist() == expected.tolist()
    assert out[1].item() == 17 and out[2].item() == 0 and out[3].item() >= 900
    assert out[0].item() % 2 == 0


@interpreted
def test_ties_and_nan_follow_torch_argmax():
    """+inf ties (any row) go to the lowest id; NaN beats everything, first NaN wins."""
    logits = torch.zeros(4, 300)
    logits[0, [250, 40, 120]] = math.inf
    logits[1, [250, 40]] = math.inf
    logits[2, [260, 70]] = math.nan
    logits[2, 5] = math.inf
    logits[3, [299]] = math.nan
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)]
    expected = torch_draw(logits, params, [0, 1, 2, 3], [0, 0, 0, 0])
    for splits in (1, 3):
        out = kernel_draw(logits, params, [0, 1, 2, 3], [0, 0, 0, 0], splits=splits, block=32)
        assert out.tolist() == expected.tolist() == [40, 40, 70, 299]


@interpreted
def test_same_row_same_token_whatever_shares_the_batch():
    gen = torch.Generator().manual_seed(12)
    row = torch.randn(1, 400, generator=gen)
    alone = kernel_draw(row, [SamplingParams(temperature=0.9)], [77], [5], block=64)
    others = torch.randn(3, 400, generator=gen)
    batch = torch.cat([others[:2], row, others[2:]])
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(temperature=0.9), SamplingParams()]
    mixed = kernel_draw(batch, params, [1, 2, 77, 3], [0, 9, 5, 4], block=64)
    assert mixed[2].item() == alone.item()


@interpreted
@settings(max_examples=12, deadline=None)
@given(
    rows=st.integers(1, 4),
    vocab=st.integers(1, 300),
    temperature=st.sampled_from([0.0, 0.2, 1.0, 3.0]),
    banned=st.floats(0.0, 1.0),
    seed=st.integers(-(2**63), 2**63 - 1),
    step=st.integers(0, 2**32 - 1),
    splits=st.sampled_from([None, 1, 2, 5]),
    data=st.data(),
)
def test_tokens_equal_torch_path_property(rows, vocab, temperature, banned, seed, step, splits, data):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    # few distinct values: exact ties between tokens are common
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float() * 0.5
    logits[torch.rand(rows, vocab, generator=gen) < banned] = -math.inf
    params = [SamplingParams(temperature=temperature if i % 2 == 0 else 0.7) for i in range(rows)]
    seeds, steps = [seed + i for i in range(rows)], [step] * rows
    expected = torch_draw(logits, params, seeds, steps)
    out = kernel_draw(logits, params, seeds, steps, splits=splits, block=32)
    assert out.tolist() == expected.tolist()


# ---------------------------------------------------------------- launcher


def test_num_splits_fill_the_gpu_and_keep_slices_long():
    assert K.num_splits(256, 151936, 2048) == 2
    assert K.num_splits(1, 151936, 2048) == 151936 // (2048 * K.MIN_TILES_PER_SPLIT)
    assert K.num_splits(1024, 151936, 2048) == 1
    assert K.num_splits(4, 1000, 2048) == 1


@interpreted
def test_bfloat16_logits_draw_as_their_float32_values():
    """The LM head's bf16 logits go to the kernel uncast: the same tokens as the torch path on
    their float32 copy (widening is exact), greedy and sampled rows alike."""
    gen = torch.Generator().manual_seed(5)
    logits = (torch.randn(5, 1000, generator=gen) * 3).to(torch.bfloat16)
    seeds, steps = [1, 2, 3, 4, 5], [7, 7, 7, 7, 7]
    expected = torch_draw(logits.float(), MIXED, seeds, steps)
    assert kernel_draw(logits, MIXED, seeds, steps, splits=None, block=128).tolist() == expected.tolist()


@interpreted
def test_launcher_checks_inputs():
    b = make_sampling_batch([SamplingParams()] * 2, [0, 1], [0, 0], "cpu")
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        K.fused_sample(torch.zeros(2, 8, dtype=torch.int32), b.temperature, b.seeds, b.steps, b.greedy)
    with pytest.raises(ValueError, match="seeds"):
        K.fused_sample(torch.zeros(2, 8), b.temperature, b.seeds[:1], b.steps, b.greedy)
    with pytest.raises(ValueError, match="greedy"):
        K.fused_sample(torch.zeros(2, 8), b.temperature, b.seeds, b.steps, b.greedy.long())
    with pytest.raises(ValueError, match="contiguous"):
        K.fused_sample(torch.zeros(8, 2).t(), b.temperature, b.seeds, b.steps, b.greedy)
    empty = make_sampling_batch([], [], [], "cpu")
    assert K.fused_sample(torch.zeros(0, 8), empty.temperature, empty.seeds, empty.steps, empty.greedy).shape == (0,)


def test_cpu_never_takes_the_fused_path():
    logits = torch.zeros(2, 8)
    assert not uses_fused_kernel(logits, make_sampling_batch([SamplingParams()] * 2, [0, 1], [0, 0], "cpu"))


# ---------------------------------------------------------------- sm_90 compile (no GPU needed)


COMPILE_SCRIPT = textwrap.dedent(
    """
    from batchinfer.kernels.compile_check import Variant, compile_variant

    ptrs = {"default": "fp32", "seed_ptr": "i64", "step_ptr": "i64", "greedy_ptr": "i1", "idx_out_ptr": "i64"}
    main = compile_variant(Variant("sampling", "_sample_split_kernel", ptrs,
                                   dict(NUM_SPLITS=2, BLOCK=2048, LIBDEVICE_LOG=True), num_warps=8))
    compile_variant(Variant("sampling", "_reduce_splits_kernel", {"default": "fp32", "idx_ptr": "i64", "out_ptr": "i64"},
                            dict(NUM_SPLITS=4, BLOCK_S=4), num_warps=1))
    compile_variant(Variant("sampling", "_noise_kernel", {"default": "i64", "u_ptr": "fp32", "g_ptr": "fp32"},
                            dict(BLOCK=1024, LIBDEVICE_LOG=True)))
    print(main.asm["ptx"])
    """
)


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_precise_math(tmp_path):
    """The interpreter cannot check libdevice calls or what `/` lowers to: compile for an H100/H200
    (no GPU needed; a fresh process, since compiled Triton cannot share one with the interpreter)
    and read the PTX: IEEE division, no approximate log, the hash on 32-bit integers."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ptx = done.stdout
    assert "div.rn.f32" in ptx and "div.full" not in ptx and "div.approx" not in ptx
    assert "lg2.approx" not in ptx
    assert ptx.count("mul.lo.s64") <= 1  # the row offset only: the hash runs on 32-bit integers


# ---------------------------------------------------------------- GPU


def _qwen_batch(rows: int, vocab: int = 151936, seed: int = 21, device: str = "cuda"):
    """Qwen-vocabulary logits with grammar-like bans on even rows and one fully banned row;
    temperatures cycle 1.0, greedy, 0.7, 1.3. Returns (logits, batch) on `device`."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    banned = torch.rand(rows, vocab, generator=gen) < 0.5
    banned[1::2] = False
    logits.masked_fill_(banned, -math.inf)
    logits[min(3, rows - 1)] = -math.inf
    temps = [1.0, 0.0, 0.7, 1.3]
    params = [SamplingParams(temperature=temps[i % 4]) for i in range(rows)]
    batch = make_sampling_batch(params, [i * 7919 for i in range(rows)], [100 + i for i in range(rows)], device)
    return logits.to(device), batch


@pytest.mark.gpu
def test_gpu_noise_is_bit_identical_to_torch_cuda():
    seeds, steps = EDGE_SEEDS.cuda(), EDGE_STEPS.cuda()
    ids = torch.arange(151936, device="cuda")
    u, g = K.kernel_noise(seeds, steps, ids)
    assert torch.equal(u, uniform_noise(seeds, steps, ids))
    assert torch.equal(g, gumbel_noise(seeds, steps, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [256, 4, 1])
def test_gpu_tokens_equal_torch_path_and_timing(rows):
    import triton.testing

    logits, batch = _qwen_batch(rows)
    assert uses_fused_kernel(logits, batch)
    fused = sample(logits, batch)
    assert fused.device.type == "cuda" and fused.dtype == torch.int64
    assert torch.equal(fused, sample(logits, batch, fused=False))
    if rows == 256:
        cpu = sample(*_qwen_batch(rows, device="cpu"))
        # torch's CPU log (SLEEF) and CUDA's logf may round one noise value differently
        assert (cpu == fused.cpu()).float().mean().item() > 0.99
    fused_ms = triton.testing.do_bench(lambda: sample(logits, batch))
    torch_ms = triton.testing.do_bench(lambda: sample(logits, batch, fused=False))
    print(f"\nsample B={rows} V={logits.shape[1]}: fused {fused_ms * 1000:.1f} us, torch {torch_ms * 1000:.1f} us")


@pytest.mark.gpu
def test_gpu_fused_path_never_syncs_and_replays_in_a_cuda_graph():
    logits, batch = _qwen_batch(64)
    expected = sample(logits, batch)  # also compiles the kernels before capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        sample(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured = sample(logits, batch)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    assert torch.equal(captured, expected)
    batch.steps.add_(1)  # the next decode step: update the device tensors in place and replay
    graph.replay()
    assert torch.equal(captured, sample(logits, batch, fused=False))
