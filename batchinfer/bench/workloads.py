"""Named benchmark workloads: random token ids with fixed seeds, so every run sees the same requests."""

from __future__ import annotations

import random
from dataclasses import dataclass

from batchinfer.engine.request import Request, SamplingParams
from batchinfer.structured.base import Constraint

DOCS_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 200},
        "summary": {"type": "string", "maxLength": 1200},
        "language": {"type": "string", "enum": ["en", "de", "fr", "es", "other"]},
        "pages": {"type": "integer", "minimum": 0, "maximum": 10000},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
    },
    "required": ["title", "summary", "language", "pages", "topics"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: list[Request]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(r.prompt_token_ids) for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.sampling.max_tokens for r in self.requests]


def _ids(rng: random.Random, n: int, low: int, high: int) -> list[int]:
    return [rng.randrange(low, high) for _ in range(n)]


def make_workload(name: str, vocab_size: int, seed: int = 0, scale: float = 1.0, count_scale: float | None = None) -> Workload:
    """nano256 | docs1000 | docs1000-json. `scale` shrinks counts and lengths (CPU smoke runs);
    count_scale, where given, shrinks the request count instead (lengths then shrink by `scale`)."""
    rng = random.Random(seed)
    high = min(vocab_size, 100_000)  # ordinary-text ids, away from special tokens at the top

    def s(x: int) -> int:
        return max(1, int(x * scale))

    def count(x: int) -> int:
        return s(x) if count_scale is None else max(1, int(x * count_scale))

    if name == "nano256":
        reqs = []
        for i in range(count(256)):
            p, o = rng.randint(s(100), s(1024)), rng.randint(s(100), s(1024))
            reqs.append(
                Request(f"nano-{i}", _ids(rng, p, 10, high), SamplingParams(max_tokens=o, temperature=0.6, ignore_eos=True, seed=i))
            )
        return Workload(name, "256 requests, prompt and output lengths uniform in [100, 1024], ignore_eos", reqs)
    if name in ("docs1000", "docs1000-json"):
        prefix = _ids(rng, s(200), 10, high)
        constraint = Constraint.json_schema(DOCS_SCHEMA) if name == "docs1000-json" else None
        reqs = []
        for i in range(count(1000)):
            doc = _ids(rng, rng.randint(s(500), s(3000)), 10, high)
            sampling = SamplingParams(max_tokens=s(200), temperature=0.0, ignore_eos=constraint is None)
            reqs.append(Request(f"doc-{i}", prefix + doc, sampling, constraint))
        desc = "1000 requests, prompts uniform in [500, 3000] tokens behind a shared 200-token prefix, 200 output tokens"
        if constraint is not None:
            desc += ", JSON schema"
        return Workload(name, desc, reqs)
    raise ValueError(f"unknown workload {name!r}; choose from nano256, docs1000, docs1000-json")


WORKLOADS = ("nano256", "docs1000", "docs1000-json")
