"""The grammar interface every structured-output backend implements.

Bitmask convention (shared with the kernels): an int32 tensor of shape [batch, ceil(vocab/32)];
bit j of word i set means token i*32 + j is allowed. A row of all ones (-1) allows everything.
"""

from __future__ import annotations

import json
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
    """

    kind: ConstraintKind
    value: str
    whitespace: str = "compact"

    @staticmethod
    def json_schema(schema: dict[str, Any] | str, whitespace: str = "compact") -> "Constraint":
        obj = json.loads(schema) if isinstance(schema, str) else schema
        return Constraint("json_schema", json.dumps(obj, separators=(",", ":"), ensure_ascii=False), whitespace)

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

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens into row `index` of an int32 CPU bitmask."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar forbids it (state unchanged)."""

    def is_terminated(self) -> bool:
        """True once the grammar has reached its end (EOS accepted, or nothing more may follow)."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative decoding)."""


class CompiledGrammar(Protocol):
    backend: str

    def new_matcher(self) -> GrammarMatcher: ...


class GrammarBackend(Protocol):
    """A grammar library behind the common interface, chosen by name."""

    name: str

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile for the tokenizer the backend was made with; raise GrammarError when it cannot."""
