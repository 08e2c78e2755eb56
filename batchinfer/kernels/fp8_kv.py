"""How the attention kernels read an FP8 (e4m3) KV cache with a 16-bit query: in float16.

Hopper converts e4m3 to float16 in one instruction for two elements (cvt.rn.f16x2.e4m3x2); it has no
e4m3 -> bf16 conversion, and the old widening through float32 (e4m3 -> f16 -> f32 -> bf16) took four
conversions per element pair, on a unit that runs a quarter as fast as plain arithmetic. So with an
FP8 cache and a bf16 or f16 query, the kernels compute both products in float16: every e4m3 value is
exact in float16, and the query, converted once per program, is scaled first by the score scale
(softmax scale x log2(e) x the cache's K scale), which keeps any bf16 query inside float16's range;
the probabilities meet V in float16 too (more mantissa than bf16). A float32 query (CPU tests of
float32 models) widens the cache to float32 instead, exactly as before.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cache_query(q, k_cache_ptr, sm_scale_log2):
    """(query, score scale) for tl.dot against tiles of this cache: for an FP8 cache and a 16-bit
    query, the query in float16 with the score scale folded in (and a scale of 1); else unchanged."""
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv and q.dtype != tl.float32:
        q = (q.to(tl.float32) * sm_scale_log2).to(tl.float16)
        sm_scale_log2 = sm_scale_log2 * 0.0 + 1.0
    return q, sm_scale_log2


@triton.jit
def as_query_type(x, q):
    """A K or V tile in the query's compute type (cache_query): FP8 -> float16 in one conversion,
    FP8 -> float32 for a float32 query; a cache in the model's dtype is left as it is."""
    if x.dtype != q.dtype:
        x = x.to(q.dtype)
    return x
