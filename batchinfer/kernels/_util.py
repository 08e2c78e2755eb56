"""Small helpers shared by the kernel launchers (block sizes, dtype checks)."""

from __future__ import annotations

import threading

import torch
import triton


def pow2(n: int, at_least: int = 1) -> int:
    """The next power of two >= max(n, at_least): Triton block shapes must be powers of two."""
    return max(triton.next_power_of_2(max(n, 1)), at_least)


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride; everything else goes through strides."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride {t.stride()})")


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs must not silently drop to TF32 in tl.dot: greedy float32 runs are compared
    token for token against transformers."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int]:
    """(num_kv_heads, GQA group size) of a paged-attention call, after checking its shapes and strides."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_last_dim_contiguous(name, t)
    return num_kv_heads, num_heads // num_kv_heads


def warm_compile_key() -> threading.Thread:
    """Start computing Triton's compiler cache key on a thread. The first kernel launch of a process
    needs it (runtime.cache.triton_key: a SHA-256 of Triton's sources and its 500 MB libtriton, then
    kept in an lru_cache): 0.4 s on the H200 host inside the engine's first forward, on the main
    thread. Hashing releases the GIL, so started before the model loads it costs that thread nothing."""
    def run() -> None:
        try:
            from triton.runtime.cache import triton_key

            triton_key()
        except Exception:  # noqa: BLE001 (only a head start: the first launch computes it as ever)
            pass

    thread = threading.Thread(target=run, name="triton-key", daemon=True)
    thread.start()
    return thread
