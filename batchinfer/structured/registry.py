"""Grammar backends by name: which there are, the order `auto` tries them in, building one.

Each backend's module is imported only when it is built for a vocabulary.

AUTO_ORDER comes from two measurements. Coverage, `bench grammar` on 200 MaskBench schemas, Qwen
151k vocabulary, this CPU: llguidance compiled 162 and passed all 162 (compile p50 6 ms); xgrammar
compiled 175, passed 173 (compile p50 0.75 s, p90 4 s); llguidance-relaxed compiled 199, passed 195;
outlines-core compiled 124, passed 114. Speed, `bench throughput --workload docs1000-json` on an
H200 (BENCHMARKS.md): xgrammar 8,166 output tok/s, llguidance 5,902, unconstrained 10,623 — in
length-bounded strings llguidance fills a 151k-token mask in ~120 µs, xgrammar in ~30 µs. But
xgrammar is not exact: it lets invalid UTF-8 byte sequences into strings (so maxLength miscounts)
and ignores maxLength next to format; those answers fail validation and become error rows. auto
keeps the exact llguidance first; `backend: xgrammar` is the faster choice where that risk is
acceptable. Every answer is validated against the full schema afterwards, whichever backend.
auto asks each backend `supports(constraint, fallback=True)` before trying it, so a backend that
would not enforce the whole schema (outlines-core's unenforced keywords) steps aside itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from batchinfer.structured.base import GrammarBackend
from batchinfer.structured.outlines_backend import OutlinesLimits
from batchinfer.structured.vocab import Vocab

BACKENDS = ("llguidance", "xgrammar", "outlines")  # one per grammar library
# "llguidance-relaxed": llguidance approximating what it does not implement (oneOf as anyOf,
# unknown keywords ignored); safe because every answer is validated against the full schema.
VARIANTS = ("llguidance-relaxed",)
AUTO_ORDER = ("llguidance", "xgrammar", "llguidance-relaxed", "outlines")


@dataclass(frozen=True)
class CompileLimits:
    """Limits on compiling one constraint.

    timeout_s: wall-clock limit for one backend's compile; one that runs past it is abandoned (its
      thread finishes in the background) and the next backend tried.
    outlines: outlines-core's child-process limits (it builds its automaton in a limited child).
    """

    timeout_s: float = 30.0
    outlines: OutlinesLimits = field(default_factory=OutlinesLimits)


def backend_order(backend: str) -> tuple[str, ...]:
    """The backends `backend` stands for, in the order they are tried."""
    if backend == "auto":
        return AUTO_ORDER
    if backend not in (*BACKENDS, *VARIANTS):
        raise ValueError(f"grammar backend must be auto, {', '.join(BACKENDS)}; not {backend!r}")
    return (backend,)


def build_backend(
    name: str, vocab: Vocab, built: dict[str, GrammarBackend], limits: CompileLimits, fill_threads: int | None
) -> GrammarBackend:
    """The backend `name` for `vocab`: from `built` (shared by the compilers of one vocabulary:
    building one for a 151k vocabulary takes about a second), else made and put there.

    fill_threads: threads for the libraries' mask fills and accepts (None: their defaults)."""
    backend = built.get(name)
    if backend is not None:
        return backend
    if name == "llguidance":
        from batchinfer.structured.llguidance_backend import LLGuidanceBackend

        backend = LLGuidanceBackend(vocab, threads=fill_threads)
    elif name == "llguidance-relaxed":
        from batchinfer.structured.llguidance_backend import LLGuidanceBackend

        base = build_backend("llguidance", vocab, built, limits, fill_threads)
        backend = LLGuidanceBackend(vocab, relaxed=True, base=base)
    elif name == "xgrammar":
        from batchinfer.structured.xgrammar_backend import XGrammarBackend

        backend = XGrammarBackend(vocab, fill_threads=fill_threads)
    elif name == "outlines":
        from batchinfer.structured.outlines_backend import OutlinesBackend

        backend = OutlinesBackend(vocab, limits.outlines)
    else:
        raise ValueError(f"unknown grammar backend {name!r}; known: {', '.join((*BACKENDS, *VARIANTS))}")
    built[name] = backend
    return backend
