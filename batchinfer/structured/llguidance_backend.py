"""llguidance behind the common grammar interface.

llguidance compiles a JSON schema in about a millisecond (it builds a lexer + Earley parser lazily,
walking the token trie at mask time), covers the most JSON-Schema features, and drops the GIL while
computing a mask. Grammars are cheap to rebuild, so nothing is cached on disk for it.
"""

from __future__ import annotations

from typing import Any

import torch

from batchinfer.structured.base import Constraint, GrammarError
from batchinfer.structured.vocab import Vocab
from batchinfer.structured.xgrammar_backend import FLEXIBLE_MAX_WHITESPACE, choice_regex


class _Wrapper:
    """The duck-typed tokenizer llguidance's TokenizerWrapper reads (tokens, EOS, encode)."""

    def __init__(self, vocab: Vocab) -> None:
        self.eos_token_id = vocab.eos_id
        self.bos_token_id = None
        # Special ids get their marker bytes so llguidance can tell them apart; it never allows
        # special tokens in a grammar's text.
        self.tokens = [b if vocab.is_normal(i) else b"" for i, b in enumerate(vocab.token_bytes)]
        self.special_token_ids = sorted(vocab.special_ids)
        self._encode = vocab.encode

    def __call__(self, data: bytes | str) -> list[int]:
        text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
        return self._encode(text)


class LLGuidanceMatcher:
    """One sequence's state; wraps llguidance.LLMatcher (which never raises on grammar errors)."""

    def __init__(self, matcher: Any, eos_ids: tuple[int, ...]) -> None:
        self._m = matcher
        self._eos = eos_ids
        self._main_eos = eos_ids[0]
        self._ended = False

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        row = bitmask[index]
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if len(self._eos) > 1:
            _mirror_eos(self, bitmask, index)

    def accept_token(self, token_id: int) -> bool:
        token_id = int(token_id)
        if self._ended or self._m.is_error():
            return False
        if token_id in self._eos:
            # EOS is ours to track: llguidance does not count an EOS taken in its stopped state
            # as a token, which would make rollback counts disagree with the other backends.
            if not self._m.is_accepting():
                return False
            self._ended = True
            return True
        if self._m.validate_tokens([token_id]) != 1:
            return False
        return bool(self._m.consume_token(token_id))

    def is_terminated(self) -> bool:
        return self._ended or (bool(self._m.is_stopped()) and not self._m.is_error())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens and not self._m.rollback(num_tokens):
            raise RuntimeError(f"llguidance cannot roll back {num_tokens} tokens: {self._m.get_error()}")

    @property
    def raw(self) -> Any:
        return self._m


def _as_int32(x: int) -> int:
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= (1 << 31) else x


class LLGuidanceCompiled:
    backend = "llguidance"

    def __init__(self, tokenizer: Any, grammar: str, eos_ids: tuple[int, ...], relaxed: bool = False) -> None:
        self.backend = "llguidance-relaxed" if relaxed else "llguidance"
        self._tok = tokenizer
        self.grammar = grammar
        self._eos = eos_ids

    def new_matcher(self) -> LLGuidanceMatcher:
        import llguidance

        return LLGuidanceMatcher(llguidance.LLMatcher(self._tok, self.grammar, log_level=0), self._eos)


class LLGuidanceBackend:
    """Compiles constraints with llguidance for one vocabulary."""

    name = "llguidance"

    def __init__(self, vocab: Vocab) -> None:
        import llguidance
        from llguidance._tokenizer import TokenizerWrapper

        self.vocab = vocab
        self._tok = llguidance.LLTokenizer(TokenizerWrapper(_Wrapper(vocab)), n_vocab=vocab.vocab_size)

    def grammar_for(self, constraint: Constraint, relaxed: bool = False) -> str:
        """The llguidance grammar text of a constraint.

        relaxed: approximate what llguidance does not implement (oneOf as anyOf, unknown keywords
        ignored) instead of refusing; answers are still validated against the full schema after
        decoding, so an approximation can only turn into an error row, never a wrong success.
        """
        import llguidance

        if constraint.kind == "json_schema":
            if constraint.whitespace == "flexible":
                opts: dict[str, Any] = dict(
                    whitespace_flexible=True, whitespace_pattern=rf"[\x20\x0A\x0D\x09]{{0,{FLEXIBLE_MAX_WHITESPACE}}}"
                )
            else:
                opts = dict(whitespace_flexible=False, item_separator=",", key_separator=":")
            if relaxed:
                opts.update(coerce_one_of=True, lenient=True)
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(constraint.value, overrides=opts)
            except ValueError as e:
                raise GrammarError(f"llguidance cannot read the schema: {e}") from e
        if constraint.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(constraint.value)
        return llguidance.LLMatcher.grammar_from_regex(choice_regex(constraint.options))

    def compile(self, constraint: Constraint, relaxed: bool = False) -> LLGuidanceCompiled:
        import llguidance

        grammar = self.grammar_for(constraint, relaxed)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tok)
        if is_error:
            raise GrammarError(f"llguidance cannot compile this {constraint.kind}: {messages[0][:300]}")
        compiled = LLGuidanceCompiled(self._tok, grammar, self.vocab.eos_ids, relaxed)
        probe = llguidance.LLMatcher(self._tok, grammar, log_level=0)
        if probe.is_error():
            raise GrammarError(f"llguidance cannot compile this {constraint.kind}: {probe.get_error()[:300]}")
        return compiled

    def batch_fill(self, matchers: list[LLGuidanceMatcher], bitmask: torch.Tensor, indices: list[int]) -> None:
        """Fill many rows at once on llguidance's thread pool."""
        import llguidance

        if not hasattr(self, "_executor"):
            self._executor = llguidance.LLExecutor()
        row_bytes = bitmask.shape[1] * 4
        self._executor.unsafe_compute_mask_ptr(
            [(m.raw, i) for m, i in zip(matchers, indices)], bitmask.data_ptr(), row_bytes, bitmask.shape[0]
        )
        for m, i in zip(matchers, indices):
            if len(m._eos) > 1:
                _mirror_eos(m, bitmask, i)


def _mirror_eos(m: LLGuidanceMatcher, bitmask: torch.Tensor, index: int) -> None:
    """llguidance knows one EOS id; where it allows it, allow the other EOS ids too."""
    row = bitmask[index]
    w, b = divmod(m._main_eos, 32)
    if (int(row[w]) >> b) & 1:
        for e in m._eos[1:]:
            we, be = divmod(e, 32)
            row[we] = _as_int32(int(row[we]) | (1 << be))


__all__ = ["LLGuidanceBackend", "LLGuidanceCompiled", "LLGuidanceMatcher"]
