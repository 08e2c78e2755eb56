"""One request's state inside the engine: its tokens, how many have KV in the cache, its blocks.

The scheduler reads and moves `num_computed_tokens` and `block_ids`; the engine appends sampled
tokens and keeps the per-request helpers (detokenizer, grammar matcher, timings) here too, so that
everything about a request lives in one object.

Token bookkeeping: `token_ids` is prompt + generated tokens. The last sampled token has no KV yet,
so a decoding sequence has exactly one token left to compute. After a preemption the sequence
recomputes all of `token_ids` (its generated tokens become part of the prefix) and samples again.

Overlap (engine/engine.py): while the step that samples a sequence's next token is still running on
the device, `token_ids` already ends with a placeholder (PENDING_TOKEN) and `pending_row` names the
row of that step's sampled-token tensor that holds the real value; the scheduler and the model
runner plan the next step with it (the runner gathers the token on the device), and the engine
swaps in the real token when it reads the step's tokens. `final_pending`: the pending token is the
sequence's last whatever its value (max_tokens or max_model_len reached), so it is not scheduled again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from batchinfer.engine.request import FinishReason, Request


PENDING_TOKEN = -1  # stands for a sampled token still on the device (never a valid token id)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Mutable per-request state. `seq_id` orders arrivals; identity (not value) equality."""

    seq_id: int
    request: Request
    token_ids: list[int]
    num_prompt_tokens: int
    max_tokens: int
    seed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Chained hashes of this sequence's full blocks (they only depend on tokens, so they survive
    # preemption); num_registered_blocks: how many of its blocks are known to the prefix table.
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_preemptions: int = 0
    admitted_step: int = 0  # the scheduler's step count when it was last admitted (prefill policy)
    pending_row: int | None = None
    final_pending: bool = False
    # Speculative decoding (engine/speculative.py): the last num_draft tokens of token_ids are
    # drafts this step verifies (never there between steps); spec: the per-sequence drafter state.
    num_draft: int = 0
    spec: Any = None
    lane: int = 0  # which of the two verify lanes schedules it (engine/lanes.py)
    # Engine-side helpers and results.
    detokenizer: Any = None
    matcher: Any = None
    # (grammar id, structured.state_keys.KeyTrack) following the answer's grammar state, so rows
    # in equal states share one mask (engine/grammar.py GrammarState); None: its mask is its own
    grammar_track: Any = None
    # (temperature, top_p, min_p, top_k, folded seed, greedy) as the sampler wants them, resolved
    # once by the model runner (sampling parameters never change during a request)
    sampling_row: tuple | None = None
    text: str = ""
    logprobs: list[Any] | None = None  # TokenLogprob per output token, when the request asks
    finish_reason: FinishReason | None = None
    error: str | None = None
    arrived: float = 0.0
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    @classmethod
    def from_request(cls, seq_id: int, request: Request, seed: int = 0, arrived: float = 0.0) -> "Sequence":
        prompt = list(request.prompt_token_ids)
        return cls(
            seq_id=seq_id,
            request=request,
            token_ids=prompt,
            num_prompt_tokens=len(prompt),
            max_tokens=request.sampling.max_tokens,
            seed=seed,
            arrived=arrived,
            logprobs=[] if request.sampling.logprobs is not None else None,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_remaining(self) -> int:
        """Tokens still without KV; the step that computes the last of them samples a new token."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    def drop_drafts(self, num: int | None = None) -> None:
        """Remove the last `num` (default: all) draft tokens from token_ids."""
        num = self.num_draft if num is None else min(num, self.num_draft)
        if num:
            del self.token_ids[-num:]
            self.num_draft -= num

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
