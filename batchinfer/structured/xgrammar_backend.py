"""xgrammar behind the common grammar interface.

xgrammar precompiles a token-mask cache per grammar (tens of ms on a 151k vocabulary) and its mask
fill releases the GIL, so it is fast per step. The compiled form serialises to JSON, which the
compiler's disk cache stores.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from batchinfer.structured.base import Constraint, GrammarError
from batchinfer.structured.vocab import Vocab

# Whitespace allowed between JSON tokens in "flexible" mode (bounded, so no runaway whitespace).
FLEXIBLE_MAX_WHITESPACE = 20


def choice_regex(options: list[str]) -> str:
    """A regex matching exactly one of the options (each escaped)."""
    import re

    return "(" + "|".join(re.escape(o) for o in options) + ")"


def json_safe_row(vocab: Vocab, flexible: bool) -> torch.Tensor:
    """Bitmask row allowing every token except those holding raw control bytes (0x00-0x1F).

    xgrammar's JSON string rule lets raw control characters through (invalid JSON); valid JSON
    never contains them outside whitespace, so they are masked off for JSON constraints
    (tab/newline/CR stay allowed in flexible whitespace mode).
    """
    import numpy as np

    ok_ctrl = {9, 10, 13} if flexible else set()
    bad = bytes(b for b in range(32) if b not in ok_ctrl)
    allowed = np.ones(((vocab.vocab_size + 31) // 32) * 32, dtype=np.uint8)
    for i, tb in enumerate(vocab.token_bytes):
        if tb and any(c in bad for c in tb):
            allowed[i] = 0
    return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())


class XGrammarMatcher:
    """One sequence's state; a thin wrapper over xgrammar.GrammarMatcher."""

    backend = "xgrammar"

    def __init__(self, matcher: Any, safe_row: torch.Tensor | None = None) -> None:
        self._m = matcher
        self.safe_row = safe_row

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, index)
        if self.safe_row is not None:
            bitmask[index] &= self.safe_row

    def accept_token(self, token_id: int) -> bool:
        return bool(self._m.accept_token(int(token_id)))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self._m.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        find = getattr(self._m, "find_jump_forward_tokens", None)  # xgrammar versions without it: none
        return [int(t) for t in find()] if find is not None else []

    def forced_text(self) -> str:
        find = getattr(self._m, "find_jump_forward_string", None)
        return str(find()) if find is not None and not self._m.is_terminated() else ""

    @property
    def raw(self) -> Any:
        return self._m


class XGrammarCompiled:
    backend = "xgrammar"

    def __init__(self, compiled: Any, eos_ids: tuple[int, ...], safe_row: torch.Tensor | None = None) -> None:
        self.compiled = compiled
        self._eos = list(eos_ids)
        self.safe_row = safe_row

    def new_matcher(self) -> XGrammarMatcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(self.compiled, override_stop_tokens=self._eos), self.safe_row)

    def serialize(self) -> bytes:
        return self.compiled.serialize_json().encode()


class XGrammarBackend:
    """Compiles constraints with xgrammar for one vocabulary (GrammarBackend)."""

    name = "xgrammar"
    library = "xgrammar"  # compiled grammars serialise to JSON: the disk cache keeps them
    # its batch fill takes the GIL back once per matcher, so on a background thread it would wait
    # ~5 ms (the interpreter's switch interval) per matcher whenever the main thread runs Python
    fills_in_background = False

    def __init__(self, vocab: Vocab, max_threads: int = 2, fill_threads: int | None = None) -> None:
        import xgrammar as xgr

        self.vocab = vocab
        self._fill_threads = fill_threads  # batch fill pool size; None: xgrammar's default
        # Special ids and padding spell b"" so xgrammar never allows them; EOS comes via stop ids.
        encoded = vocab.text_bytes()
        self._info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.RAW, vocab_size=vocab.vocab_size, stop_token_ids=list(vocab.eos_ids)
        )
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads, cache_enabled=False)
        self._safe_rows: dict[bool, torch.Tensor] = {}

    def supports(self, constraint: Constraint, fallback: bool = False) -> str | None:
        return None  # it says what it cannot compile when it tries (compile raises GrammarError)

    def compile(self, constraint: Constraint) -> XGrammarCompiled:
        try:
            if constraint.kind == "json_schema":
                if constraint.whitespace == "flexible":
                    kw: dict[str, Any] = dict(any_whitespace=True, max_whitespace_cnt=FLEXIBLE_MAX_WHITESPACE)
                else:
                    kw = dict(any_whitespace=False, separators=(",", ":"))
                compiled = self._compiler.compile_json_schema(constraint.value, strict_mode=False, **kw)
            elif constraint.kind == "regex":
                compiled = self._compiler.compile_regex(constraint.value)
            else:
                compiled = self._compiler.compile_regex(choice_regex(constraint.options))
        except Exception as e:  # xgrammar raises RuntimeError / InvalidJSONError with the construct
            raise GrammarError(f"xgrammar cannot compile this {constraint.kind}: {_first_line(e)}") from e
        return XGrammarCompiled(compiled, self.vocab.eos_ids, self._safe_row(constraint))

    def _safe_row(self, constraint: Constraint) -> torch.Tensor | None:
        if constraint.kind != "json_schema":
            return None
        flexible = constraint.whitespace == "flexible"
        if flexible not in self._safe_rows:
            self._safe_rows[flexible] = json_safe_row(self.vocab, flexible)
        return self._safe_rows[flexible]

    def deserialize(self, data: bytes, constraint: Constraint) -> XGrammarCompiled:
        import xgrammar as xgr

        compiled = xgr.CompiledGrammar.deserialize_json(data.decode(), self._info)
        return XGrammarCompiled(compiled, self.vocab.eos_ids, self._safe_row(constraint))

    def fill_call(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor, indices: list[int]) -> Callable[[], None]:
        """The fill of rows indices[k] for matchers[k] with xgrammar's threaded batch matcher (no safe rows yet)."""
        import xgrammar as xgr

        if not hasattr(self, "_batch"):
            self._batch = xgr.BatchGrammarMatcher(self._fill_threads or "auto")
        return partial(self._batch.batch_fill_next_token_bitmask, [m.raw for m in matchers], bitmask, list(indices))

    def finish_rows(self, matchers: list[XGrammarMatcher], bitmask: torch.Tensor, indices: list[int]) -> None:
        """After the fill: AND each row with its matcher's JSON-safe row, one op per distinct safe row."""
        groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for m, i in zip(matchers, indices):
            if m.safe_row is not None:
                groups.setdefault(id(m.safe_row), (m.safe_row, []))[1].append(i)
        for safe, rows in groups.values():
            idx = torch.as_tensor(rows, dtype=torch.long)
            bitmask[idx] &= safe

    def accept_tokens(self, matchers: list[XGrammarMatcher], tokens: list[int]) -> list[bool]:
        """accept_token for many matchers in one call into xgrammar (a rejected token changes nothing)."""
        import xgrammar as xgr

        return [bool(x) for x in xgr.BatchGrammarMatcher.batch_accept_token([m.raw for m in matchers], list(tokens))]


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:300] if "\n" in text else text[:300]


__all__ = ["XGrammarBackend", "XGrammarCompiled", "XGrammarMatcher", "choice_regex"]
