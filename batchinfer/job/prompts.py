"""Rows to prompts: a sandboxed Jinja template over the row's columns, or a column of chat messages,
then the model's chat template.

Why sandboxed: templates come from job files, which may be shared; the sandbox blocks attribute
tricks. Why strict: a missing or null column must fail that row with a message naming the column,
not silently render as an empty string.

Chat messages (`prompt.messages`, and an OpenAI Batch line's body.messages): a list of
{role, content}, any number of turns, roles system | developer (taken as system) | user |
assistant. Content is text, or OpenAI content parts of type text (joined by newlines). Tool turns
(role tool, tool_calls) and non-text parts (images, audio) are row errors: no tool runs here and the
models read text. The job's prompt.system is prepended unless the messages have a system message.
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
# Chat roles a message may have, and the role the chat template gets.
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class RowError(ValueError):
    """A problem with one row (missing/null/non-scalar column, render error, prompt too long)."""


def _env() -> ImmutableSandboxedEnvironment:
    return ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False, keep_trailing_newline=True)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or OpenAI content parts of type text."""
    if isinstance(content, str):
        return content
    if content is None:
        raise RowError(f"{where}.content is null")
    if isinstance(content, (list, tuple)):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                got = repr(kind) if kind is not None else type(part).__name__
                raise RowError(f"{where}.content[{j}] is not a text part (got {got}); only text content is supported")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RowError(f"{where}.content is not text (got {type(content).__name__})")


def chat_messages(value: Any, where: str) -> list[dict[str, str]]:
    """Check a list of {role, content} chat messages; returns them as the chat template wants them.

    Raises RowError naming `where` (the column) and the entry: not a list, empty, an entry that is
    not an object, an unknown role, a tool turn, content that is not text.
    """
    if value is None:
        raise RowError(f"messages column '{where}' is null")
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)):
        raise RowError(f"messages column '{where}' is not a list of {{role, content}} messages (got {type(value).__name__})")
    if not value:
        raise RowError(f"messages column '{where}' is an empty list")
    out = []
    for i, m in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise RowError(f"{at} is not a {{role, content}} object (got {type(m).__name__})")
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise RowError(f"{at}: tool turns (role tool, tool_calls) are not supported")
        if role not in ROLES:
            raise RowError(f"{at}: unknown role {role!r} (use system, developer, user or assistant)")
        out.append({"role": ROLES[role], "content": _text(m.get("content"), at)})
    return out


def column_value(row: dict[str, Any], name: str) -> Any:
    """row[name], or a nested field for a dotted name (`body.messages`); RowError when it is missing."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            raise RowError(f"messages column '{name}' is missing")
        value = value[part]
    return value


class PromptBuilder:
    """Renders a row into prompt text and token ids for one tokenizer.

    chat: apply the tokenizer's chat template (default: when the tokenizer has one). Without chat, the
    system text (if any) is a first paragraph and the tokenizer adds its special tokens. With
    spec.messages the row's chat messages are the prompt (the chat template is required).
    """

    def __init__(self, spec: PromptSpec, tokenizer: Any) -> None:
        self.spec = spec
        self.tokenizer = tokenizer
        has_chat = bool(getattr(tokenizer, "chat_template", None))
        if spec.chat and not has_chat:
            raise JobError("prompt.chat is true but the model's tokenizer has no chat template")
        if spec.messages is not None and not has_chat:
            raise JobError(f"prompt.messages ({spec.messages}) needs a chat template, and the model's tokenizer has none")
        self.chat = has_chat if spec.chat is None else spec.chat
        env = _env()
        try:
            self._template = env.from_string(spec.template) if spec.template is not None else None
            self._system = env.from_string(spec.system) if spec.system else None
            names = set(jinja2.meta.find_undeclared_variables(env.parse(spec.template))) if spec.template is not None else set()
            if spec.system:
                names |= jinja2.meta.find_undeclared_variables(env.parse(spec.system))
        except jinja2.TemplateSyntaxError as e:
            raise JobError(f"prompt template: Jinja syntax error on line {e.lineno}: {e.message}") from None
        self.template_columns = sorted(names)  # the scalar columns the Jinja reads
        if spec.messages is not None:  # a nested name reads its top-level column
            names |= {spec.messages, spec.messages.split(".")[0]}
        self.columns = sorted(names)

    def _check(self, row: dict[str, Any]) -> None:
        for name in self.template_columns:
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
        assert self._template is not None, "a messages prompt has no user template"
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

    def messages(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The chat messages of a row (messages prompts): the column's, after the job's system prompt
        unless they have their own. Raises RowError naming the column and the entry."""
        assert self.spec.messages is not None
        messages = chat_messages(column_value(row, self.spec.messages), self.spec.messages)
        if self._system is not None and not any(m["role"] == "system" for m in messages):
            self._check(row)
            try:
                system = self._system.render(row)
            except Exception as e:  # sandbox, undefined, a filter failing on this row
                raise RowError(f"prompt.system failed on this row: {type(e).__name__}: {e}") from None
            messages = [{"role": "system", "content": system}, *messages]
        return messages

    def prompt(self, row: dict[str, Any]) -> str:
        """The full prompt text (chat template applied when chat)."""
        if self.spec.messages is not None:
            messages = self.messages(row)
        else:
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

    def encode_many(self, rows: list[dict[str, Any]]) -> list[tuple[str, list[int]] | RowError]:
        """encode() of each row, with one tokenizer call for the batch (a fast tokenizer encodes the
        batch without the GIL, over its threads); a row whose prompt fails gets its RowError."""
        texts: list[str] = []
        out: list[Any] = []
        for row in rows:
            try:
                texts.append(self.prompt(row))
                out.append(None)
            except RowError as e:
                out.append(e)
        ids = iter(self.tokenizer(texts, add_special_tokens=not self.chat)["input_ids"] if texts else [])
        text = iter(texts)
        return [x if x is not None else (next(text), list(next(ids))) for x in out]
