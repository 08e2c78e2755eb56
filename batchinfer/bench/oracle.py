"""Oracle drafts for benchmarking speculative decoding on random weights.

Random weights never agree with n-gram drafts, so the bench records each request's output in a plain
run of the workload and then drafts the true continuation, with a chosen share of draft tokens
replaced by a different random token (`corrupt`), to emulate a given acceptance. What it measures is
the cost and gain of verification, not the quality of a draft source.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence as Seq

from batchinfer.engine.speculative import Drafter


def oracle_drafter(truth: Mapping[str, Seq[int]], corrupt: float, vocab_size: int, seed: int = 0) -> Drafter:
    """A Drafter whose drafts are each request's recorded output from where its sequence is now."""
    if not 0.0 <= corrupt <= 1.0:
        raise ValueError(f"--oracle-corrupt must be in [0, 1], got {corrupt}")
    rng = random.Random(seed)
    draw, pick, empty = rng.random, rng.randrange, ()

    def draft(seq, k: int) -> list[int]:
        done = seq.num_generated
        out = list(truth.get(seq.request.request_id, empty)[done : done + k])
        if corrupt:
            for j, t in enumerate(out):
                if draw() < corrupt:
                    out[j] = (t + 1 + pick(vocab_size - 1)) % vocab_size
        return out

    return draft
