"""How many compiled variants each Triton kernel of this package holds (a diagnostic).

Triton compiles a kernel once per signature: dtypes, constexprs, and the integer arguments it
specialises on (== 1, divisible by 16) unless told not to (`do_not_specialize`). An argument
that changes from step to step (a block-table width, a token count) therefore costs a fresh
compile (~1 s) in the middle of a run. `bench throughput` compares the counts before and after
its measured run and reports any kernel that compiled inside it.
"""

from __future__ import annotations

import importlib
import pkgutil


def compiled_variants() -> dict[str, int]:
    """kernel name -> number of compiled variants, over every jitted function in batchinfer.kernels
    (0 each under TRITON_INTERPRET=1, where nothing is compiled)."""
    import triton

    import batchinfer.kernels as pkg

    counts: dict[str, int] = {}
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in ("compile_check", "jit_stats"):
            continue
        try:
            module = importlib.import_module(f"{pkg.__name__}.{info.name}")
        except ImportError:
            continue
        for name, obj in vars(module).items():
            if not isinstance(obj, triton.runtime.jit.KernelInterface):
                continue
            caches = getattr(obj, "device_caches", None) or {}
            n = 0
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                n += len(cache) if hasattr(cache, "__len__") else 0
            counts[f"{info.name}.{name}"] = n
    return counts


def compiled_since(before: dict[str, int]) -> dict[str, int]:
    """Kernels that gained variants since `before` (a compiled_variants() snapshot), with how many."""
    now = compiled_variants()
    return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}
