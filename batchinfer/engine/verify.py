"""The host side of a speculative verify step (engine/speculative.py runs the step).

A sampling sequence with k drafts has k+1 consecutive sampling rows (its `width`), one per output
position g .. g+k (g: its tokens generated before the drafts). This module builds what those rows
need (the sampler's counter and the min_tokens bans of each position), finds the accepted prefix of
each draft from the tokens the target drew, and appends the emitted tokens (the accepted drafts and
the draw after them) with the same stop checks as plain decoding (engine/finish.py).

Everything per row is numpy; per sequence, one pass (settle_drafts). Sequences without a grammar, stop strings or
logprobs (most rows of a plain batch job) append their run of tokens at once (finish.append_tokens);
the others append column by column, one batched grammar accept per column, as plain decoding does
one token per step. Finishing happens in the order plain decoding would see it: by the column of
the finishing token, then by row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from batchinfer.engine.finish import append_token, append_tokens, make_result
from batchinfer.engine.request import Result
from batchinfer.engine.sequence import Sequence

_NO_BANS: list[int] = []  # shared by every row with no banned token (the sampler only reads it)


def row_starts(widths: np.ndarray) -> np.ndarray:
    """The first sampling row of each sequence."""
    return np.cumsum(widths) - widths


def generated_before(sampling: list[Sequence]) -> np.ndarray:
    """Tokens each sequence had generated before this step's drafts (its first row's position)."""
    return np.fromiter((s.num_generated - s.num_draft for s in sampling), dtype=np.int64, count=len(sampling))


def row_steps(first: np.ndarray, widths: np.ndarray) -> np.ndarray:
    """The sampler's counter of every sampling row: first[i] + j at sequence i's j-th row."""
    total = int(widths.sum())
    return np.repeat(first - row_starts(widths), widths) + np.arange(total, dtype=np.int64)


def row_bans(sampling: list[Sequence], widths: np.ndarray, first: np.ndarray,
             bans_at: Callable[[Sequence, int], list[int]]) -> list[list[int]] | None:
    """The tokens banned at every sampling row (min_tokens at its position); None when no row bans any."""
    mins = np.fromiter((s.request.sampling.min_tokens for s in sampling), dtype=np.int64, count=len(sampling))
    if not (first < mins).any():
        return None
    bans: list[list[int]] = []
    for seq, w, g, low in zip(sampling, widths.tolist(), first.tolist(), mins.tolist()):
        bans += [_NO_BANS] * w if g >= low else [bans_at(seq, g + j) for j in range(w)]
    return bans


def settle_drafts(sampling: list[Sequence], widths: list[int], tokens: list[int], counts: Any,
                  plans: dict[int, Any]) -> tuple[list[list[int]], list[bool]]:
    """Per sampling sequence (its k = width-1 drafts still at the end of token_ids): the tokens it
    emits (the leading drafts equal to the tokens drawn at their positions, then the draw after
    them), its drafts removed, its verify result counted into `counts` (SpecCounts; plans: the
    step's _Plan by id(seq)) and fed to its DraftLength. Returns the emitted tokens and whether
    each sequence decodes (it is not finishing a prefill)."""
    emitted: list[list[int]] = []
    decoding: list[bool] = []
    row = rows = verified = accepted = 0
    for seq, w in zip(sampling, widths):
        out = tokens[row : row + w]
        row += w
        ids, c = seq.token_ids, seq.num_computed_tokens
        decoding.append(c >= seq.num_prompt_tokens and c + w == len(ids))
        if w == 1:
            emitted.append(out)
            continue
        k = w - 1
        base, a = len(ids) - k, 0
        while a < k and ids[base + a] == out[a]:
            a += 1
        seq.drop_drafts()
        emitted.append(out[: a + 1])
        rows, verified, accepted = rows + 1, verified + k, accepted + a
        plan = plans.get(id(seq))
        grammar = count_grammar_part(counts, plan, k, a) if plan is not None and (plan.forced or plan.text) else 0
        if seq.spec is not None and a >= grammar:  # the n-gram part was reached: measure it
            seq.spec.length.update(k - grammar, a - grammar)
    counts.rows += rows
    counts.verified += verified
    counts.accepted += accepted
    counts.decode_rows += sum(decoding)
    return emitted, decoding


def count_grammar_part(counts: Any, plan: Any, k: int, a: int) -> int:
    """Count the grammar-forced and forced-text drafts among a sequence's k verified drafts (a
    accepted); returns how many of the k they are (the n-gram part follows them)."""
    forced = min(plan.forced, k)
    text = min(plan.text, k - forced)
    counts.forced_verified += forced
    counts.forced_accepted += min(a, forced)
    counts.text_verified += text
    counts.text_accepted += max(0, min(a - forced, text))
    return forced + text


def append_emitted(
    engine: Any, sampling: list[Sequence], emitted: list[list[int]], first_rows: list[int], logprobs: Any, now: float
) -> tuple[list[int], list[Result]]:
    """Append each sequence's emitted tokens (its drafts removed already) until one finishes it;
    finish those. Returns the tokens appended per sequence and the finished sequences' Results.
    first_rows[i]: sequence i's first sampling row (its logprobs' rows)."""
    appended = [0] * len(sampling)
    finished: list[tuple[int, int]] = []  # (column of the finishing token, sequence index)
    columns: list[int] = []  # sequences appended column by column
    eos, max_len, tok = engine.eos_token_ids, engine.max_model_len, engine.tokenizer
    for i, seq in enumerate(sampling):
        if seq.matcher is None and seq.detokenizer is None and seq.logprobs is None:
            n, done = append_tokens(seq, emitted[i], now, eos, max_len, tok)
            appended[i] = n
            if done:
                finished.append((n - 1, i))
        else:
            columns.append(i)
    if columns:
        _append_by_column(engine, sampling, emitted, first_rows, logprobs, now, columns, appended, finished)
    finished.sort()
    results = []
    for _, i in finished:
        engine.scheduler.finish(sampling[i])
        results.append(make_result(sampling[i]))
    return appended, results


def _append_by_column(engine: Any, sampling: list[Sequence], emitted: list[list[int]], first_rows: list[int],
                      logprobs: Any, now: float, alive: list[int], appended: list[int],
                      finished: list[tuple[int, int]]) -> None:
    """append_emitted for sequences with a grammar, stop strings or logprobs: column by column, one
    batched grammar accept per column."""
    col = 0
    while alive:
        pairs = [(sampling[i], emitted[i][col]) for i in alive]
        verdicts = engine.grammar.accept(pairs)
        still = []
        for i, (seq, token), verdict in zip(alive, pairs, verdicts):
            if logprobs is not None and seq.logprobs is not None:
                seq.logprobs.append(logprobs.entry(first_rows[i] + col, token))
            appended[i] = col + 1
            if append_token(seq, token, now, verdict, engine.eos_token_ids, engine.max_model_len, engine.tokenizer):
                finished.append((col, i))
            elif col + 1 < len(emitted[i]):
                still.append(i)
        alive = still
        col += 1
