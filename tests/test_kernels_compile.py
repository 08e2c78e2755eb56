"""Compile every Triton kernel for an H100/H200 (sm_90) on this CPU-only machine.

The interpreter tests check the math but not what only the GPU compiler checks (tl.dot shape
limits, constexpr branches, early returns, types, shared-memory size). Ahead-of-time compilation
to a cubin needs no GPU: Triton ships ptxas. Marked slow (several seconds per attention kernel).
"""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.slow

triton = pytest.importorskip("triton")

H100_SHARED_MEMORY = 227 * 1024


def compile_sm90(fn, pointer_types: dict[str, str], constexprs: dict, floats=(), num_warps=4, num_stages=2):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointer_types.get(name, pointer_types["default"])
        else:
            signature[name] = "fp32" if name in floats else "i32"
    return triton.compile(
        ASTSource(fn, signature, constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The kernel modules imported without the interpreter, and a private Triton cache."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set for the whole process")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
        import importlib
        import sys

        mods = {}
        for name in ("cache", "decode_attention", "extend_attention", "rmsnorm", "rotary", "activation", "bitmask"):
            full = f"batchinfer.kernels.{name}"
            mods[name] = importlib.reload(sys.modules[full]) if full in sys.modules else importlib.import_module(full)
        if not isinstance(mods["cache"]._reshape_and_cache_kernel, triton.runtime.JITFunction):
            pytest.skip("kernels were decorated under the interpreter")
        yield mods


def test_attention_kernels_compile_for_sm90(kernels):
    ints = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32", "mid_o_ptr": "fp32", "mid_lse_ptr": "fp32"}
    decode = compile_sm90(
        kernels["decode_attention"]._decode_split_kernel, {"default": "bf16", **ints},
        dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, NUM_SPLITS=8, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, DOT_PREC="tf32"),
        floats=("sm_scale_log2",),
    )
    compile_sm90(
        kernels["decode_attention"]._decode_reduce_kernel, {"default": "bf16", **ints},
        dict(HEAD_DIM=128, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128),
    )
    # GQA 7:1 with head_dim 96 exercises the padded head and head_dim paths
    extend = compile_sm90(
        kernels["extend_attention"]._extend_kernel, {"default": "bf16", **ints},
        dict(GROUP=7, HEAD_DIM=96, BLOCK_SIZE=32, BLOCK_M=8, BLOCK_G=8, BLOCK_N=64, BLOCK_D=128, DOT_PREC="tf32"),
        floats=("sm_scale_log2",),
    )
    for k in (decode, extend):
        assert 0 < k.metadata.shared <= H100_SHARED_MEMORY


def test_elementwise_kernels_compile_for_sm90(kernels):
    compile_sm90(
        kernels["cache"]._reshape_and_cache_kernel, {"default": "bf16", "slot_ptr": "i64"},
        dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128),
    )
    for residual in (False, True):
        compile_sm90(
            kernels["rmsnorm"]._rms_norm_kernel, {"default": "bf16"},
            dict(N=3584, BLOCK=4096, HAS_RESIDUAL=residual), floats=("eps",), num_warps=16,
        )
    compile_sm90(
        kernels["rotary"]._rotary_kernel, {"default": "bf16", "pos_ptr": "i64", "cos_ptr": "fp32", "sin_ptr": "fp32"},
        dict(HQ=28, HK=4, HALF=64, BLOCK_HQ=32, BLOCK_HK=4, BLOCK_R=64),
    )
    compile_sm90(kernels["activation"]._silu_and_mul_kernel, {"default": "bf16"}, dict(BLOCK=1024))
    compile_sm90(kernels["bitmask"]._bitmask_kernel, {"default": "fp32", "mask_ptr": "i32"}, dict(BLOCK=4096))
