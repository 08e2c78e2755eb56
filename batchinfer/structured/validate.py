"""Checking a finished answer against its full constraint.

Grammars enforce most of a schema while decoding, but no library enforces all of it (formats,
uniqueItems, multipleOf, ...), so every answer is validated again after decoding. An answer that
fails becomes an error naming the violated constraint (JSON path + validator), never a success.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from batchinfer.structured.base import Constraint


@lru_cache(maxsize=64)
def _validator(schema_text: str) -> Any:
    import jsonschema

    schema = json.loads(schema_text)
    cls = jsonschema.validators.validator_for(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@lru_cache(maxsize=64)
def _regex(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern)


def json_path(path: Any) -> str:
    """'$.items[2].name' from a jsonschema error's absolute_path."""
    out = "$"
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(p)) else f"[{json.dumps(p)}]")
    return out


def validate_output(constraint: Constraint, text: str) -> tuple[Any, str | None]:
    """(parsed value, None) when the answer satisfies the constraint, else (None, error message).

    json_schema: parse as JSON and validate with jsonschema (formats checked where jsonschema can);
    regex: full match; choice: exact membership. The parsed value of a regex/choice answer is the text.
    """
    if constraint.kind == "json_schema":
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return None, f"answer is not valid JSON ({e.msg} at character {e.pos}); it may have been cut short"
        import jsonschema

        error = jsonschema.exceptions.best_match(_validator(constraint.value).iter_errors(value))
        if error is not None:
            schema_path = "/".join(str(p) for p in error.absolute_schema_path)
            return None, (
                f"answer violates the schema at {json_path(error.absolute_path)}: "
                f"{error.validator} ({error.message[:200]}) [schema: {schema_path}]"
            )
        return value, None
    if constraint.kind == "regex":
        if _regex(constraint.value).fullmatch(text) is None:
            return None, f"answer does not fully match the regex {constraint.value!r}: {text[:80]!r}"
        return text, None
    if constraint.kind == "choice":
        options = constraint.options
        if text not in options:
            return None, f"answer {text[:80]!r} is not one of the {len(options)} choices"
        return text, None
    return None, f"unknown constraint kind {constraint.kind!r}"
