"""Compile every kernel for an H100/H200 (sm_90) without a GPU: `python -m batchinfer.kernels.compile_check`.

The interpreter checks the math but not what only the GPU compiler checks (tl.dot shape limits,
constexpr branches, early returns, types, shared memory). Ahead-of-time compilation to a cubin
needs no GPU (Triton ships ptxas). Must run in a process where Triton is not interpreted
(TRITON_INTERPRET unset when triton is first imported). Prints one line per kernel variant and
exits non-zero if any fails or needs more shared memory than an H100 has.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field

H100_SHARED_MEMORY = 227 * 1024
UNALIGNED_STRIDES = ("s_bt",)  # a block table's row: max blocks per sequence, any count


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation: pointer element types by argument name ("default" for the rest),
    constexpr values, the float scalars, and launch options."""

    module: str
    kernel: str
    pointers: dict[str, str]
    constexprs: dict[str, object]
    floats: tuple[str, ...] = ()
    num_warps: int = 4
    num_stages: int = 2
    label: str = field(default="")


ATTN_PTRS = {"block_tables_ptr": "i32", "seq_lens_ptr": "i32", "qsl_ptr": "i32", "tiles_ptr": "i32", "mid_o_ptr": "fp32", "mid_lse_ptr": "fp32"}

VARIANTS = [
    Variant("decode_attention", "_decode_split_kernel", {"default": "bf16", **ATTN_PTRS},
            dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=128, DOT_PREC="tf32",
                 DIRECT=False),
            ("sm_scale_log2", "v_scale"), num_stages=3, label="llama-8b bf16"),
    Variant("decode_attention", "_decode_split_kernel",
            {"default": "bf16", **ATTN_PTRS, "mid_o_ptr": "bf16", "mid_lse_ptr": "bf16"},
            dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=64, DOT_PREC="tf32",
                 DIRECT=True),
            ("sm_scale_log2", "v_scale"), label="qwen3 bf16, one split"),
    Variant("decode_attention", "_decode_split_kernel", {"default": "fp16", **ATTN_PTRS},
            dict(GROUP=7, HEAD_DIM=64, BLOCK_SIZE=32, BLOCK_H=16, BLOCK_D=64, BLOCK_N=64, DOT_PREC="tf32", DIRECT=False),
            ("sm_scale_log2", "v_scale"), label="qwen2-0.5b fp16"),
    Variant("decode_attention", "_decode_reduce_kernel", {"default": "bf16", **ATTN_PTRS},
            dict(HEAD_DIM=128, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128)),
    Variant("extend_attention", "_extend_kernel", {"default": "bf16", **ATTN_PTRS},
            dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=16, ROWS=64, BLOCK_N=64, BLOCK_D=128, DOT_PREC="tf32"),
            ("sm_scale_log2", "v_scale"), label="llama-8b bf16"),
    Variant("extend_attention", "_extend_kernel", {"default": "bf16", **ATTN_PTRS},
            dict(GROUP=7, HEAD_DIM=96, BLOCK_SIZE=32, BLOCK_M=9, ROWS=64, BLOCK_N=64, BLOCK_D=128, DOT_PREC="tf32"),
            ("sm_scale_log2", "v_scale"), label="GQA 7:1, head_dim 96"),
    Variant("cache", "_reshape_and_cache_kernel", {"default": "bf16", "slot_ptr": "i64"},
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, FP8=False),
            ("k_scale", "v_scale", "fp8_max")),
    Variant("cache", "_reshape_and_cache_kernel",
            {"default": "bf16", "slot_ptr": "i64", "k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv"},
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, FP8=True),
            ("k_scale", "v_scale", "fp8_max"), label="FP8 cache"),
    Variant("decode_attention", "_decode_split_kernel",
            {"default": "bf16", **ATTN_PTRS, "k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv"},
            dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=16, BLOCK_D=128, BLOCK_N=128, DOT_PREC="tf32",
                 DIRECT=False),
            ("sm_scale_log2", "v_scale"), num_stages=3, label="llama-8b, FP8 cache"),
    Variant("extend_attention", "_extend_kernel",
            {"default": "bf16", **ATTN_PTRS, "k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv"},
            dict(GROUP=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=16, ROWS=64, BLOCK_N=64, BLOCK_D=128, DOT_PREC="tf32"),
            ("sm_scale_log2", "v_scale"), label="llama-8b, FP8 cache"),
    Variant("rmsnorm", "_rms_norm_kernel", {"default": "bf16"}, dict(N=3584, BLOCK=4096, HAS_RESIDUAL=False, FP8_OUT=False),
            ("eps", "fp8_max", "min_scale"), num_warps=16),
    Variant("rmsnorm", "_rms_norm_kernel", {"default": "bf16"}, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True, FP8_OUT=False),
            ("eps", "fp8_max", "min_scale"), num_warps=16),
    Variant("rmsnorm", "_rms_norm_kernel", {"default": "bf16", "out_ptr": "fp8e4nv", "scale_ptr": "fp32"},
            dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True, FP8_OUT=True), ("eps", "fp8_max", "min_scale"), num_warps=16,
            label="llama-8b, FP8 output"),
    Variant("rotary", "_rotary_kernel", {"default": "bf16", "pos_ptr": "i64", "cos_ptr": "fp32", "sin_ptr": "fp32"},
            dict(HQ=28, HK=4, HALF=64, BLOCK_HQ=32, BLOCK_HK=4, BLOCK_R=64)),
    Variant("activation", "_silu_and_mul_kernel", {"default": "bf16"}, dict(BLOCK=1024)),
    Variant("activation", "_silu_and_mul_fp8_kernel", {"default": "bf16", "q_ptr": "fp8e4nv", "scale_ptr": "fp32"},
            dict(BLOCK=2048), ("fp8_max", "min_scale"), num_warps=8),
    Variant("bitmask", "_bitmask_kernel", {"default": "fp32", "mask_ptr": "i32"}, dict(BLOCK=4096)),
    Variant("fp8_quant", "_quant_fp8_rows_kernel", {"default": "bf16", "q_ptr": "fp8e4nv", "scale_ptr": "fp32"},
            dict(BLOCK=1024), ("fp8_max", "min_scale")),
]


def compile_variant(v: Variant):
    """triton.compile the variant for sm_90; returns the compiled kernel."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(f"batchinfer.kernels.{v.module}"), v.kernel)
    signature = {}
    constexprs = dict(v.constexprs)
    for param in fn.params:  # a constexpr the variant leaves out takes its default, as a launch does
        if param.is_constexpr and param.has_default and param.name not in constexprs:
            constexprs[param.name] = param.default
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + v.pointers.get(name, v.pointers["default"])
        else:
            signature[name] = "fp32" if name in v.floats else "i32"
    # what a launch specialises on (Triton's "D": divisible by 16): the pointers, and the strides
    # (multiples of head_dim / hidden / block counts); else the loads would not be vectorised here
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name].startswith("*") or (name.startswith("s_") and name not in UNALIGNED_STRIDES)}
    return triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": v.num_warps, "num_stages": v.num_stages},
    )


def main() -> int:
    from batchinfer.kernels.interpreter import triton_is_interpreted

    if triton_is_interpreted():
        print("TRITON_INTERPRET=1 was set when triton was imported; run without it", file=sys.stderr)
        return 2
    failures = 0
    for v in VARIANTS:
        name = f"{v.module}.{v.kernel} {v.label}".strip()
        try:
            shared = compile_variant(v).metadata.shared
        except Exception:
            failures += 1
            print(f"FAIL {name}\n{traceback.format_exc()}")
            continue
        ok = shared <= H100_SHARED_MEMORY
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name}: shared memory {shared} bytes")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
