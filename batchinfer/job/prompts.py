"""Rows to prompts: a sandboxed Jinja template over the row's columns, then the model's chat template.

Why sandboxed: templates come from job files, which may be shared; the sandbox blocks attribute
tricks. Why strict: a missing or null column must fail that row with a message naming the column,
not silently render as an empty string.
"""

from __future__ import annotations

import datetime as dt
import decimal
from typing import Any

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchinfer.job.spec import JobError, PromptSpec

# Values a template may render; anything else (lists, dicts, bytes) is a row error.
SCALARS = (str, int, float, bool, dt.date, dt.datetime, dt.time, decimal.Decimal)


class RowError(ValueError):
    """A problem with one row (missing/null/non-scalar column, render error, prompt too long)."""


def _env() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)


class PromptBuilder:
    """Renders a row into prompt text and token ids for one tokenizer.

    chat: apply the tokenizer's chat template (default: when the tokenizer has one). Without chat, the
    system text (if any) is a first paragraph and the tokenizer adds its special tokens.
    """

    def __init__(self, spec: PromptSpec, tokenizer: Any) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if spec.chat and not has_chat:
            raise JobError("prompt.chat is true but the model's tokenizer has no chat template")
        self.chat = has_chat if spec.chat is None else spec.chat
        env = _env()
        try:
            self._template = env.from_string(spec.template)
            self._system = env.from_string(spec.system) if spec.system else None
            names = set(jinja2.meta.find_undeclared_variables(env.parse(spec.template)))
            if spec.system:
                names |= jinja2.meta.find_undeclared_variables(env.parse(spec.system))
        except jinja2.TemplateSyntaxError as e:
            raise JobError(f"prompt template: Jinja syntax error on line {e.lineno}: {e.message}") from None
        self.columns = sorted(names)

    def _check(self, row: dict[str, Any]) -> None:
        for name in self.columns:
            if name not in row:
                raise RowError(f"template column '{name}' is missing")
            value = row[name]
            if value is None:
                raise RowError(f"template column '{name}' is null")
            if not isinstance(value, SCALARS):
                raise RowError(f"template column '{name}' is not a string or number (got {type(value).__name__})")

    def render_text(self, row: dict[str, Any]) -> tuple[str | None, str]:
        """(system, user) text of a row; raises RowError naming the problem."""
        self._check(row)
        try:
            user = self._template.render(row)
            system = self._system.render(row) if self._system else None
        except jinja2.UndefinedError as e:
            raise RowError(f"template: {e.message}") from None
        except jinja2.exceptions.SecurityError as e:
            raise RowError(f"template: blocked by the sandbox: {e}") from None
        except Exception as e:  # a filter failing on this row's value, etc.
            raise RowError(f"template failed on this row: {type(e).__name__}: {e}") from None
        return system, user

    def prompt(self, row: dict[str, Any]) -> str:
        """The full prompt text (chat template applied when chat)."""
        system, user = self.render_text(row)
        if not self.chat:
            return f"{system}\n\n{user}" if system else user
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise RowError(f"chat template failed: {type(e).__name__}: {e}") from None

    def encode(self, row: dict[str, Any]) -> tuple[str, list[int]]:
        """(prompt text, token ids). The chat template already holds the special tokens."""
        text = self.prompt(row)
        ids = self.tokenizer(text, add_special_tokens=not self.chat)["input_ids"]
        return text, list(ids)
