"""Would a library's attention kernel close issue 17's prefill gap? Our paged extend kernel against
torch's own FlashAttention-2 (aten._flash_attention_forward, variable lengths, GQA, causal from the
bottom right) on the same prefill work, one layer, no model.

Why: on every shape the prefill attention runs at 210-306 TF/s, about a third of the GEMMs' rate, and no
launch setting of our Triton kernel gains more than 9% (BENCHMARKS.md, extend kernel over released
shapes). FlashAttention-2 reads contiguous K/V; our cache is paged in 16-token blocks (its paged mode
wants pages of 256), so the probe also times the gather of each prefilling sequence's K/V from the cache
into contiguous buffers, which a step would pay once per layer. If flash + gather is not clearly
faster than our kernel, integrating it is not worth its weight. A third path: scaled_dot_product_attention
on its cuDNN backend (cuDNN 9's Hopper kernels), one call per sequence over the gathered K/V with a
lower-right causal mask.

For each (shape, workload) of scripts/extend_shape_sweep.py (prefill: 3 x 2,600 new tokens after 200
cached; chunks: 8 x 512 after 1,000): the max abs error of each path against kernels.reference, then
the median of 10 CUDA-graph replays of: ours (default launch), the gather alone, flash alone, gather +
flash, cuDNN (sdpa); TF/s of the causal FLOPs. A path that fails (an op missing from this torch, a capture
error) is reported and left out.

Usage (device tool): python3 scripts/flash_prefill_probe.py [--shapes a,b] [--workloads prefill,chunks]
CPU check of the gather, the cumulative lengths and the masks (a PyTorch varlen reference stands in for
flash, SDPA's math backend for cuDNN):
    python3 scripts/flash_prefill_probe.py --cpu-smoke
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # extend_shape_sweep beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # batchinfer without PYTHONPATH

import extend_shape_sweep as sweep

SHAPES = "qwen3-0.6b,llama-3.1-8b,qwen2.5-1.5b,qwen2.5-7b"


def gather_index(batch: sweep.Batch, work: sweep.Workload) -> torch.Tensor:
    """Cache slots (block * BLOCK_SIZE + offset) of every context token of every sequence, in order."""
    tables = batch.block_tables.cpu().numpy()
    slots = [tables[b, np.arange(n) // sweep.BLOCK_SIZE] * sweep.BLOCK_SIZE + np.arange(n) % sweep.BLOCK_SIZE
             for b, n in enumerate(work.seq_lens)]
    return torch.from_numpy(np.concatenate(slots).astype(np.int64)).to(batch.q.device)


def cumulative(lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last positions) over its keys, float32 math
    (aten_flash's arguments; the longest lengths are not needed)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k.shape[1]
    for b in range(cu_q.shape[0] - 1):
        qs, qe, ks, ke = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb = q[qs:qe].float().transpose(0, 1)
        kb = k[ks:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[ks:ke].float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = qb @ kb.transpose(1, 2) * scale
        n_q, n_k = qe - qs, ke - ks
        allowed = torch.arange(n_k, device=q.device)[None, :] <= torch.arange(n_q, device=q.device)[:, None] + (n_k - n_q)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = (scores.softmax(-1) @ vb).transpose(0, 1).to(q.dtype)
    return out


def sdpa_per_sequence(batch: sweep.Batch, work: sweep.Workload, k: torch.Tensor, v: torch.Tensor,
                      backend: object) -> Callable[[], torch.Tensor]:
    """scaled_dot_product_attention on one of its backends (cuDNN on the GPU), one call per sequence over
    its gathered K/V, causal from the bottom right as a boolean mask (the cuDNN backend takes a mask,
    not torch's lower-right causal bias), GQA by enable_gqa; the outputs written back into one buffer."""
    from torch.nn.attention import sdpa_kernel

    dev = batch.q.device
    q_starts = np.concatenate([[0], np.cumsum(work.q_lens)]).tolist()
    k_starts = np.concatenate([[0], np.cumsum(work.seq_lens)]).tolist()
    masks = [torch.ones(n, c + n, dtype=torch.bool, device=dev).tril(diagonal=c)
             for c, n in zip(work.ctx_before, work.q_lens)]
    out = torch.empty_like(batch.q)

    def call() -> torch.Tensor:
        with sdpa_kernel([backend]):
            for b, mask in enumerate(masks):
                qs, qe, ks, ke = q_starts[b], q_starts[b + 1], k_starts[b], k_starts[b + 1]
                o = torch.nn.functional.scaled_dot_product_attention(
                    batch.q[qs:qe].transpose(0, 1).unsqueeze(0), k[ks:ke].transpose(0, 1).unsqueeze(0),
                    v[ks:ke].transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=batch.scale, enable_gqa=True)
                out[qs:qe] = o[0].transpose(0, 1)
        return out

    return call


def paths(batch: sweep.Batch, work: sweep.Workload, flash: Callable, sdpa_backend: object) -> dict[str, Callable[[], object]]:
    """The timed calls over one batch (buffers allocated here, so the calls are graph capturable)."""
    index = gather_index(batch, work)
    kv_heads, dim = batch.k_cache.shape[2], batch.k_cache.shape[3]
    k_flat, v_flat = batch.k_cache.view(-1, kv_heads, dim), batch.v_cache.view(-1, kv_heads, dim)
    k = torch.empty((index.shape[0], kv_heads, dim), dtype=batch.q.dtype, device=batch.q.device)
    v = torch.empty_like(k)
    cu_q, cu_k = cumulative(work.q_lens, batch.q.device), cumulative(work.seq_lens, batch.q.device)
    max_q, max_k = max(work.q_lens), max(work.seq_lens)

    def gather() -> None:
        torch.index_select(k_flat, 0, index, out=k)
        torch.index_select(v_flat, 0, index, out=v)

    def attend() -> torch.Tensor:
        return flash(batch.q, k, v, cu_q, cu_k, max_q, max_k, batch.scale)

    def both() -> torch.Tensor:
        gather()
        return attend()

    gather()
    return {"ours": sweep.kernel_call(batch, work, sweep.DEFAULT_CONFIG), "gather": gather, "flash": attend,
            "gather+flash": both, "sdpa": sdpa_per_sequence(batch, work, k, v, sdpa_backend)}


def aten_flash(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> torch.Tensor:
    """torch's FlashAttention-2, variable lengths (GQA: fewer K/V heads), causal from the bottom right."""
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)[0]


def probe(shapes: list[tuple[str, int, int, int]], works: list[sweep.Workload], dtype: torch.dtype, device: str,
          timer: Callable[[Callable[[], object]], float], flash: Callable, sdpa_backend: object,
          tolerance: float) -> list[dict]:
    from batchinfer.kernels import reference

    rows = []
    for s, (name, heads, kv_heads, dim) in enumerate(shapes):
        for w, work in enumerate(works):
            batch = sweep.build_batch(work, heads, kv_heads, dim, dtype, device, seed=100 * s + w)
            expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                                 batch.seq_lens, batch.query_start_loc, batch.scale)
            flops = sweep.causal_flops(work, heads, dim)
            row: dict = {"shape": name, "workload": work.name, "ms": {}, "err": {}}
            for label, call in paths(batch, work, flash, sdpa_backend).items():
                try:
                    out = call()
                    if label in ("ours", "flash", "sdpa"):
                        row["err"][label] = sweep.max_diff(out, expected)
                    row["ms"][label] = timer(call)
                except Exception as exc:  # noqa: BLE001 (an op this torch lacks, a launch that cannot be captured)
                    row["ms"][label] = None
                    row.setdefault("errors", []).append(f"{label}: {type(exc).__name__}: {str(exc)[:120]}")
            bad = [k for k, e in row["err"].items() if not e < tolerance]
            times = "  ".join(f"{k} {m:.3f} ms" + (f" ({flops / m / 1e9:.0f} TF/s)" if k != "gather" else "")
                              for k, m in row["ms"].items() if m is not None)
            print(f"{name} {heads}/{kv_heads}/{dim} {work.name}: {times}"
                  + (f"  BAD {bad}" if bad else "") + "".join(f"  [{e}]" for e in row.get("errors", [])))
            rows.append(row)
            del batch, expected
    return rows


def print_summary(rows: list[dict]) -> None:
    print(f"\n{'shape':<14}{'workload':<9}{'ours ms':>9}{'flash ms':>10}{'gather ms':>11}{'sdpa ms':>9}"
          f"{'ours/(gather+flash)':>21}{'ours/(gather+sdpa)':>20}  err ours / flash / sdpa")
    for r in rows:
        ms = r["ms"]

        def ratio(path: str, ms: dict = ms) -> str:
            return f"x{ms['ours'] / (ms['gather'] + ms[path]):.2f}" if ms.get("ours") and ms.get("gather") and ms.get(path) else "-"

        def fmt(x: float | None) -> str:
            return f"{x:.3f}" if x else "-"

        errs = " / ".join(f"{r['err'][k]:.1e}" if k in r["err"] else "-" for k in ("ours", "flash", "sdpa"))
        print(f"{r['shape']:<14}{r['workload']:<9}{fmt(ms.get('ours')):>9}{fmt(ms.get('flash')):>10}"
              f"{fmt(ms.get('gather')):>11}{fmt(ms.get('sdpa')):>9}{ratio('flash'):>21}{ratio('sdpa'):>20}  {errs}")


def cpu_smoke() -> None:
    """The gather and the cumulative lengths, checked on the CPU: the PyTorch varlen reference over the
    gathered K/V must match the paged reference (and our kernel, interpreted)."""
    from batchinfer.kernels.interpreter import triton_is_interpreted

    assert triton_is_interpreted(), "Triton was imported before TRITON_INTERPRET=1 was set"
    from torch.nn.attention import SDPBackend

    rows = probe([("smoke-g2", 4, 2, 64)], sweep.smoke_workloads(), torch.float32, "cpu", sweep.plain_time,
                 varlen_reference, SDPBackend.MATH, sweep.SMOKE_TOLERANCE)
    print_summary(rows)
    for r in rows:
        assert "errors" not in r and len(r["err"]) == 3 and all(e < sweep.SMOKE_TOLERANCE for e in r["err"].values()), r
    print("cpu smoke ok")


def main() -> None:
    ap = argparse.ArgumentParser(description="Our extend kernel against torch's FlashAttention-2 (module docstring).")
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated names of scripts/extend_shape_sweep.py's shapes")
    ap.add_argument("--workloads", default="prefill,chunks", help="comma-separated, of prefill, chunks, verify, verify64")
    ap.add_argument("--reps", type=int, default=10, help="CUDA-graph replays per path (median)")
    ap.add_argument("--cpu-smoke", action="store_true", help="check the gather on the CPU (Triton interpreter)")
    args = ap.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (kernels/interpreter.py)
        cpu_smoke()
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --cpu-smoke)")
    from batchinfer.bench.gpu_timing import graph_ms

    rng = np.random.default_rng(0)
    works = [sweep.make_workload(n, rng) for n in args.workloads.split(",") if n]
    from torch.nn.attention import SDPBackend

    rows = probe(sweep.select_shapes(args.shapes), works, torch.bfloat16, "cuda", lambda fn: graph_ms(fn, args.reps),
                 aten_flash, SDPBackend.CUDNN_ATTENTION, sweep.GPU_TOLERANCE)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; ms = median of {args.reps} graph replays")
    print_summary(rows)


if __name__ == "__main__":
    main()
