"""Incremental detokenisation and stop-string search.

IncrementalDetokenizer turns output token ids into text one token at a time with the standard
prefix/read-offset technique: it decodes only a short window (the tokens of the last emitted
piece plus the ones not yet emitted) twice, once without and once with the new tokens, and
emits the difference. The cost per token is O(1) in the output length.

Text is emitted only once its bytes are complete: while the window's text ends with U+FFFD (a
multi-byte UTF-8 character split across tokens, or bytes that may still become one), nothing is
emitted; flush() emits what is left at the end. For byte-level BPE tokenizers the concatenation
of everything emitted equals tokenizer.decode(output_ids, skip_special_tokens=...) exactly.

A few prompt tokens are decoded as left context (as SentencePiece tokenizers need to keep the
leading space of the first output word); they are dropped when the prompt's text does not end on
a character boundary, so they can never change the output's first character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded as left context


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """A function ids -> text, without tokenization-space cleanup (it is not local, so it cannot
    be applied piecewise; transformers skips it for BPE tokenizers anyway).

    A Hugging Face fast tokenizer is decoded by its Rust backend directly (what its decode()
    does, minus Python overhead); anything else through its decode().
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """Turns one request's output tokens into text, one token at a time.

    add(token_id) returns the newly final text; text is all output text so far; flush() returns
    what was held back (call it once, when the request ends).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        context = [int(t) for t in list(prompt_token_ids)[-PROMPT_CONTEXT_TOKENS:]]
        if context and self._decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends mid-character: its bytes would merge into the output's
        self._ids: list[int] = context
        self._prefix_offset = 0  # window start: first token of the last emitted piece
        self._read_offset = len(context)  # first token whose text is not emitted yet
        self._text = ""
        self.output_token_ids: list[int] = []

    @property
    def text(self) -> str:
        """All output text emitted so far (held-back bytes excluded until flush)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the text that became final with it (maybe "")."""
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""  # nothing new, or bytes that may still complete a character
        piece = new_text[len(prefix_text) :]
        self._emit(piece)
        return piece

    def flush(self) -> str:
        """Emit whatever is held back (incomplete or invalid bytes become U+FFFD, as decode does)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        piece = new_text[len(prefix_text) :]
        self._emit(piece)
        return piece

    def _emit(self, piece: str) -> None:
        self._text += piece
        # Drop the tokens before the new window so the list does not grow with the output.
        start = self._read_offset
        self._ids = self._ids[start:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)


def find_stop_string(text: str, stops: Sequence[str], num_new_chars: int) -> int | None:
    """Index at which `text` must be cut because a stop string occurs in it, else None.

    Only occurrences that end inside the last `num_new_chars` characters are looked for (earlier
    ones were found on earlier calls), so the cost does not grow with the text. The earliest
    such occurrence wins; the stop string itself is cut off.
    """
    if num_new_chars <= 0 or not stops:
        return None
    new_start = max(len(text) - num_new_chars, 0)
    best: int | None = None
    for stop in stops:
        if not stop:
            continue
        begin = max(new_start - len(stop) + 1, 0)
        index = text.find(stop, begin)
        if index != -1 and (best is None or index < best):
            best = index
    return best
