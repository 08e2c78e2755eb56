"""Finishing sequences: whether an appended token ends one, its final text, its Result.

A sampled token is checked against the stop token ids and EOS, the grammar's verdict, stop strings
(through the sequence's detokenizer), max_tokens and max_model_len (append_token; append_tokens
appends a run of tokens of a sequence without grammar or stop strings, as speculative decoding emits).
"""

from __future__ import annotations

from typing import Any

from batchinfer.engine.detokenizer import find_stop_string
from batchinfer.engine.request import RequestTimes, Result
from batchinfer.engine.sequence import Sequence

_NONE: frozenset[int] = frozenset()


def append_token(
    seq: Sequence, token: int, now: float, verdict: str | None, eos_ids: frozenset[int], max_model_len: int, tokenizer: Any
) -> bool:
    """Add a sampled token; decide whether the sequence is finished (and why, with its text). True if finished.

    verdict: what the grammar said of the token (engine/grammar.py GrammarState.accept; None without
    a grammar). A final EOS / stop token id stays in output_token_ids but not in the text.
    """
    p = seq.request.sampling
    seq.token_ids.append(token)
    if seq.first_token is None:
        seq.first_token = now
    ends_by_id = token in p.stop_token_ids or (token in eos_ids and not p.ignore_eos)
    reason: str | None = "stop" if ends_by_id else None
    error: str | None = None
    text: str | None = None
    if verdict == "rejected":
        reason = "error"
        error = f"request {seq.request.request_id}: the grammar rejected sampled token {token}"
    elif verdict == "terminated":
        reason = reason or "stop"
    if seq.detokenizer is not None and not ends_by_id:
        new = seq.detokenizer.add(token)
        if reason is None and seq.num_generated >= p.min_tokens:  # as vLLM: not before min_tokens
            cut = find_stop_string(seq.detokenizer.text, p.stop, len(new))
            if cut is not None:
                reason, text = "stop", seq.detokenizer.text[:cut]
    if reason is None and (seq.num_generated >= seq.max_tokens or seq.num_tokens >= max_model_len):
        reason = "length"
    if reason is None:
        return False
    seq.finish_reason, seq.error = reason, error
    seq.text = text if text is not None else final_text(seq, tokenizer, drop_last=ends_by_id)
    seq.finished = now
    return True


def append_tokens(
    seq: Sequence, tokens: list[int], now: float, eos_ids: frozenset[int], max_model_len: int, tokenizer: Any
) -> tuple[int, bool]:
    """append_token for each of `tokens` in turn, up to the first that finishes the sequence, for a
    sequence with no grammar (verdicts None) and no stop strings (no detokenizer): the same checks,
    run once over the tokens (speculative decoding appends several per step). Returns (tokens
    appended, finished)."""
    if seq.detokenizer is not None:
        raise ValueError("append_tokens is for sequences without stop strings; use append_token")
    p = seq.request.sampling
    ids = seq.token_ids
    # appending this many reaches max_tokens or max_model_len
    limit = min(seq.max_tokens - (len(ids) - seq.num_prompt_tokens), max_model_len - len(ids))
    stops, eos = p.stop_token_ids, (_NONE if p.ignore_eos else eos_ids)
    n, ends_by_id = 0, False
    for token in tokens:
        n += 1
        if token in eos or token in stops:
            ends_by_id = True
            break
        if n >= limit:
            break
    if n == 0:
        return 0, False
    ids.extend(tokens[:n] if n < len(tokens) else tokens)
    if seq.first_token is None:
        seq.first_token = now
    if not ends_by_id and n < limit:
        return n, False
    seq.finish_reason, seq.error = ("stop" if ends_by_id else "length"), None
    seq.text = final_text(seq, tokenizer, drop_last=ends_by_id)
    seq.finished = now
    return n, True


def final_text(seq: Sequence, tokenizer: Any, drop_last: bool) -> str:
    """The answer's text: the detokenizer's (flushed, cut at a stop string) or the output decoded
    (without its final stop/EOS id when drop_last)."""
    if seq.detokenizer is not None:
        piece = seq.detokenizer.flush()  # bytes held back at the end
        text = seq.detokenizer.text
        cut = find_stop_string(text, seq.request.sampling.stop, len(piece))
        return text if cut is None else text[:cut]
    ids = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
    return tokenizer.decode(ids, skip_special_tokens=seq.request.sampling.skip_special_tokens)


def make_result(seq: Sequence) -> Result:
    """The Result of a finished (or refused) sequence."""
    prompt = list(seq.token_ids[: seq.num_prompt_tokens])
    output = list(seq.output_token_ids)
    return Result(
        request_id=seq.request.request_id,
        prompt_token_ids=prompt,
        output_token_ids=output,
        text=seq.text,
        finish_reason=seq.finish_reason,
        prompt_tokens=len(prompt),
        completion_tokens=len(output),
        error=seq.error,
        times=RequestTimes(seq.arrived, seq.scheduled, seq.first_token, seq.finished),
        num_preemptions=seq.num_preemptions,
        logprobs=tuple(seq.logprobs) if seq.logprobs is not None else None,
    )
