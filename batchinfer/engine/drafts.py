"""Draft sources and draft lengths of speculative decoding (engine/speculative.py verifies them).

Three sources, in the order a draft takes them:
  forced: the tokens the grammar forces (GrammarMatcher.forced_tokens): always right.
  text: the rest of the text the grammar forces (GrammarMatcher.forced_text), tokenised by the
    model's tokenizer. Where several tokenisations of the forced text are allowed (`":"` as one
    token or as `":` then `"`), the library stops its forced tokens; the model mostly picks the
    tokenizer's own encoding, so those tokens are good drafts, not sure ones.
  ngram: prompt lookup. The longest recent suffix of the sequence's tokens that occurs earlier in
    its prompt + output proposes what followed there. Tokens are compared by a match key that
    ignores a leading space (`ĠNS` in "number: NS-2024" and `NS` in `"NS-2024"` are the same key):
    an answer that copies a document's value inside JSON quotes starts it without the space the
    document has, and token-exact matching missed every such copy.

Draft length (DraftLength): each sequence estimates the chance `p` that its next n-gram draft token
is accepted, from its own verify results (decayed counts of accepted tokens and of rejections: a
draft of geometric acceptance), and drafts the j-th n-gram token only while p**j, the chance that
the j-th is reached and accepted, is at least `accept_threshold`. A sequence whose p falls below it
drafts no n-gram tokens; it probes with one every `probe_interval` steps, so drafting resumes when
its output starts copying again. Grammar sources are not limited by it (forced tokens are always
right; their share of a draft is counted apart).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np

LEADING_SPACES = ("Ġ", "▁", " ")  # byte-level BPE, SentencePiece, plain vocabularies
DECAY = 0.8  # weight of older verify results in DraftLength's estimate, per step with n-gram drafts
TEXT_CACHE = 4096  # forced-text tokenisations kept (the same keys repeat across rows of a job)


def ngram_draft(tokens: np.ndarray, sizes: Seq[int], k: int, keys: np.ndarray | None = None) -> np.ndarray:
    """Up to k tokens following the most recent earlier occurrence of the longest suffix of
    `tokens` (sizes tried in order) that occurs earlier; empty when none does. keys: the match
    key of every token (match_keys), compared instead of the tokens; the draft is tokens."""
    length = tokens.shape[0]
    if k <= 0:
        return tokens[:0]
    keys = tokens if keys is None else keys
    for n in sizes:
        if length <= n:
            continue
        suffix = keys[length - n :]
        # windows starting at 0 .. length-1-n: each has at least one token after it
        windows = np.lib.stride_tricks.sliding_window_view(keys[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


def match_keys(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """key[token id]: the id of the same token without its leading space where the vocabulary has
    that token, else the id itself (ids beyond the tokenizer's vocabulary map to themselves)."""
    keys = np.arange(vocab_size, dtype=np.int64)
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return keys
    vocab = get_vocab()
    for piece, i in vocab.items():
        if 0 <= i < vocab_size and len(piece) > 1 and piece[0] in LEADING_SPACES:
            j = vocab.get(piece[1:])
            if j is not None and 0 <= j < vocab_size:
                keys[i] = j
    return keys


class ForcedText:
    """Tokens of the grammar-forced text beyond the forced tokens (the `text` source)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._encoded: dict[str, list[int]] = {}
        self._decoded: dict[tuple[int, ...], str] = {}

    def extend(self, matcher: Any, forced: list[int], room: int) -> list[int]:
        """Up to `room` tokens of the forced text that follows the `forced` tokens; [] if none."""
        if room <= 0 or self.tokenizer is None:
            return []
        text = matcher.forced_text()
        if not text:
            return []
        covered = self._decode(forced) if forced else ""
        if len(text) <= len(covered) or not text.startswith(covered):
            return []
        return self._encode(text[len(covered) :])[:room]

    def _encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= TEXT_CACHE:
                self._encoded.clear()
            ids = self._encoded[text] = [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
        return ids

    def _decode(self, tokens: list[int]) -> str:
        key = tuple(tokens)
        text = self._decoded.get(key)
        if text is None:
            if len(self._decoded) >= TEXT_CACHE:
                self._decoded.clear()
            text = self._decoded[key] = self.tokenizer.decode(tokens, clean_up_tokenization_spaces=False)
        return text


@dataclass
class DraftLength:
    """A sequence's n-gram draft length from its measured acceptance (see the module docstring)."""

    accepted: float = 1.0  # decayed count of accepted n-gram draft tokens (a prior of one)
    rejected: float = 0.0  # decayed count of verify steps whose n-gram draft was cut by a rejection
    idle: int = 0  # steps since the last n-gram draft while switched off

    @property
    def p(self) -> float:
        """Estimated chance that the next n-gram draft token is accepted."""
        return self.accepted / (self.accepted + self.rejected)

    def length(self, most: int, threshold: float, probe_interval: int) -> int:
        """n-gram draft tokens to propose now (0: off; 1 on every probe_interval-th step while off)."""
        p, k = self.p, 0
        while k < most and p ** (k + 1) >= threshold:
            k += 1
        if k == 0 and most > 0:
            self.idle += 1
            if self.idle >= probe_interval:
                self.idle = 0
                return 1
        return k

    def update(self, verified: int, accepted: int) -> None:
        """Record a verify step of `verified` n-gram draft tokens of which the first `accepted` were right."""
        if verified <= 0:
            return
        self.idle = 0
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < verified else 0.0)
