"""Small helpers shared by the kernel launchers (block sizes, dtype checks, Triton's cache key)."""

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


COMPILE_KEY_THREAD = "triton-key"


def live_thread(name: str) -> threading.Thread | None:
    """The running thread called `name`, if there is one: how a start-once helper finds its earlier start."""
    return next((t for t in threading.enumerate() if t.name == name and t.is_alive()), None)


def warm_compile_key() -> threading.Thread:
    """Start computing Triton's compiler cache key on a thread, or return the one already computing it.

    The first kernel launch of a process needs the key (runtime.cache.triton_key: a SHA-256 of
    Triton's sources and its 500 MB libtriton, then kept in an lru_cache): 0.3-0.4 s on an H100
    host. Hashing releases the GIL, so a thread started early costs the main thread nothing, and a
    caller about to launch its first kernel joins it instead of hashing again beside it (the
    lru_cache does not make a second caller wait: sampled on the device, both threads hashed at once,
    BENCHMARKS.md). Once the key is computed, a new thread finds it cached and ends at once."""
    running = live_thread(COMPILE_KEY_THREAD)
    if running is not None:
        return running

    def run() -> None:
        try:
            from triton.runtime.cache import triton_key

            triton_key()
        except Exception:  # noqa: BLE001 (only a head start: the first launch computes it as ever)
            pass

    thread = threading.Thread(target=run, name=COMPILE_KEY_THREAD, daemon=True)
    thread.start()
    return thread
