"""The engine's public request and result types (its Python API)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from batchinfer.structured.base import Constraint

FinishReason = Literal["stop", "length", "error"]
MAX_LOGPROBS = 20  # most alternatives per token (SamplingParams.logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. temperature 0 is greedy; top_k 0 and top_p 1.0 and min_p 0.0 are off.

    seed: None draws one from the engine's seed; the same seed and prompt give the same output
    whatever else shares the batch.
    stop: strings that end the output (cut from the text); stop_token_ids: ids that end it
    (not part of the text). EOS ends the output unless ignore_eos.
    logprobs: None (off) or K in 0..20: each output token's log-probability and the K most likely
    tokens at its position, in `Result.logprobs` (engine/logprobs.py says which distribution).
    """

    max_tokens: int = 256
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be in [0, max_tokens]")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 is off)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] (or null: off)")


@dataclass(frozen=True)
class Request:
    """One generation request. The engine never looks at `prompt`; it is kept for results."""

    request_id: str
    prompt_token_ids: tuple[int, ...] | list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    constraint: Constraint | None = None
    prompt: str | None = None


@dataclass(frozen=True)
class RequestTimes:
    """Wall-clock times (time.perf_counter seconds) of one request's life in the engine."""

    arrived: float
    scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One output token: its id, its log-probability, and the K most likely (id, logprob) at its
    position, most likely first (K = SamplingParams.logprobs)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Result:
    """One finished request. finish_reason is stop | length | error; error is None unless it failed.
    logprobs (requests with SamplingParams.logprobs set): one entry per output_token_ids entry."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    times: RequestTimes | None = None
    num_preemptions: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per output token when the request asked
