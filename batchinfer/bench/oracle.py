"""Oracle drafts for benchmarking speculative decoding on random weights.

Random weights never agree with n-gram drafts, so the bench records each request's output in a plain
run of the workload and then drafts the true continuation, with a chosen share of draft tokens
replaced by a different random token (`corrupt`), to emulate a given acceptance. What it measures is
the cost and gain of verification, not the quality of a draft source.

A measured run can leave the recorded output: in bf16 a step's numerics depend on its batch, and a
random model's near-tied logits can then pick another token (the suspected reason docs1000 read
0.49-0.58 acceptance at 10% corruption, where 6-token drafts give ~0.59, BENCHMARKS.md nineteenth
session; not yet measured with this check). From there the recording knows
nothing of the sequence, so the oracle drafts nothing for it while its latest ALIGN_TOKENS output
tokens differ from the recording's, instead of a wrong draft at every step: the drafts it does make
stay right but for the corrupted share.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence as Seq

from batchinfer.engine.speculative import Drafter

ALIGN_TOKENS = 4  # output tokens compared with the recording before each draft (stateless: the bench's
# warm-up run and its measured run share request ids and one drafter)


def oracle_drafter(truth: Mapping[str, Seq[int]], corrupt: float, vocab_size: int, seed: int = 0) -> Drafter:
    """A Drafter whose drafts are each request's recorded output from where its sequence is now;
    none where the sequence's latest output tokens are not the recording's (module docstring)."""
    if not 0.0 <= corrupt <= 1.0:
        raise ValueError(f"--oracle-corrupt must be in [0, 1], got {corrupt}")
    rng = random.Random(seed)
    draw, pick, empty = rng.random, rng.randrange, ()

    def draft(seq, k: int) -> list[int]:
        true = truth.get(seq.request.request_id, empty)
        done = seq.num_generated
        tail = min(done, ALIGN_TOKENS)  # the latest output tokens must be the recording's
        if tail and seq.token_ids[len(seq.token_ids) - tail :] != list(true[done - tail : done]):
            return []
        out = list(true[done : done + k])
        if corrupt:
            for j, t in enumerate(out):
                if draw() < corrupt:
                    out[j] = (t + 1 + pick(vocab_size - 1)) % vocab_size
        return out

    return draft
