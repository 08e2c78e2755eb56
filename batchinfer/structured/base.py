"""The grammar interface every structured-output backend implements.

Bitmask convention (shared with the kernels): an int32 tensor of shape [batch, ceil(vocab/32)];
bit j of word i set means token i*32 + j is allowed. A row of all ones (-1) allows everything.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

ConstraintKind = Literal["json_schema", "regex", "choice"]


class GrammarError(ValueError):
    """A constraint that a backend (or every backend) cannot compile; the message names the construct."""


@dataclass(frozen=True)
class Constraint:
    """What an answer must match. Hashable, so compiled grammars can be cached by it.

    kind json_schema: value is the schema as compact JSON text, keys in the schema's own order
      (property order is the order the answer's fields are generated in, so it is kept).
    kind regex: value is the pattern.
    kind choice: value is a JSON list of the allowed strings.
    whitespace: compact (no free whitespace in JSON) | flexible.
    max_string_length: json_schema only: the grammar bounds every string without a (smaller)
      maxLength to this many characters (None: strings bounded only by the schema).
    """

    kind: ConstraintKind
    value: str
    whitespace: str = "compact"
    max_string_length: int | None = None

    @staticmethod
    def json_schema(schema: dict[str, Any] | str, whitespace: str = "compact", max_string_length: int | None = None) -> "Constraint":
        obj = json.loads(schema) if isinstance(schema, str) else schema
        return Constraint("json_schema", json.dumps(obj, separators=(",", ":"), ensure_ascii=False), whitespace, max_string_length)

    @staticmethod
    def regex(pattern: str) -> "Constraint":
        return Constraint("regex", pattern)

    @staticmethod
    def choice(options: list[str] | tuple[str, ...]) -> "Constraint":
        if not options:
            raise GrammarError("choice needs at least one option")
        return Constraint("choice", json.dumps(list(options)))

    @property
    def schema(self) -> dict[str, Any]:
        if self.kind != "json_schema":
            raise AttributeError("only json_schema constraints have a schema")
        return json.loads(self.value)

    @property
    def options(self) -> list[str]:
        if self.kind != "choice":
            raise AttributeError("only choice constraints have options")
        return json.loads(self.value)


class GrammarMatcher(Protocol):
    """Per-sequence state of a compiled grammar."""

    backend: str  # name of the GrammarBackend whose batch calls (fill_call, accept_tokens) take it

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of an int32 CPU bitmask."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar forbids it (state unchanged)."""

    def is_terminated(self) -> bool:
        """True once the grammar has reached its end (EOS accepted, or nothing more may follow)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding)."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here whatever the model would pick (the forced text,
        tokenised by the library; may differ from the tokenizer's own encoding), [] if none or the
        backend cannot tell. The state is unchanged. Speculative decoding drafts them."""

    def forced_text(self) -> str:
        """The text the grammar forces from here ("" if none or the backend cannot tell). It may go
        on past forced_tokens where several tokenisations of it are allowed. The state is unchanged.
        Speculative decoding drafts its tokenizer encoding (engine/drafts.py)."""


class CompiledGrammar(Protocol):
    """A constraint compiled for one vocabulary; hands out matchers at its start."""

    backend: str  # what compiled it: a backend name (llguidance-relaxed for the relaxed variant)

    def new_matcher(self) -> GrammarMatcher: ...

    def serialize(self) -> bytes:
        """The compiled form for the disk cache (only called where GrammarBackend.library is set)."""
        ...


class GrammarBackend(Protocol):
    """A grammar library behind the common interface, chosen by name (structured/registry.py).

    Callers never ask which backend they have: a backend says what it can compile (`supports`), and
    the batch calls take the matchers it made (GrammarMatcher.backend names it).
    """

    name: str
    # distribution whose version keys the disk cache of compiled forms; None: nothing is cached on
    # disk (compiling is cheaper than reading a cache entry back)
    library: str | None
    # the call fill_call returns runs with the GIL released for the whole call, so it may run on a
    # helper thread while the caller keeps working (structured/compiler.py PendingFill)
    fills_in_background: bool

    def supports(self, constraint: Constraint, fallback: bool = False) -> str | None:
        """None if this backend will try to compile the (well-formed) constraint; otherwise why not.
        fallback: asked while trying backends in turn (backend auto), where a backend that would
        not enforce the whole constraint, or would be slow to build it, should rather step aside."""

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile for the vocabulary the backend was made with; raise GrammarError when it cannot."""

    def deserialize(self, data: bytes, constraint: Constraint) -> CompiledGrammar:
        """A compiled grammar back from CompiledGrammar.serialize() (only where library is set)."""

    def fill_call(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, indices: list[int]) -> Callable[[], None]:
        """The fill of rows indices[k] of a CPU int32 bitmask for matchers[k], all at once (the
        library's own threads where it has them), its arguments prepared now, on the caller's thread:
        calling it runs only the library (a helper thread that runs it then needs the GIL for no
        more than the call). finish_rows completes the rows."""

    def finish_rows(self, matchers: list[GrammarMatcher], bitmask: torch.Tensor, indices: list[int]) -> None:
        """After the fill (on the caller's thread): any per-row correction the library's fill does
        not make itself. fill_call()() then finish_rows equals fill_next_token_bitmask per row."""

    def accept_tokens(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list[bool]:
        """accept_token(tokens[k]) for each matchers[k], in one call where the library batches; the
        accepted flags. A rejected token may leave a matcher unusable (callers end that sequence)."""
