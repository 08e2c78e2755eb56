"""JSON Schema -> Arrow type, so parsed answers land in a typed `output` column.

Objects with known properties become structs, arrays lists, integer/number/boolean/string the
matching scalars; $ref/$defs are resolved. Where a schema has no single Arrow type (anyOf of
different types, additionalProperties maps, free-form objects, recursion) the value is stored as
JSON text (string) instead.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

_SCALARS = {"integer": pa.int64(), "number": pa.float64(), "boolean": pa.bool_(), "string": pa.string()}
_MAX_DEPTH = 32


def _resolve(node: Any, root: dict[str, Any], seen: tuple[str, ...]) -> tuple[Any, tuple[str, ...]]:
    """Follow local $ref chains ('#/$defs/x', '#/definitions/x'); recursion returns None."""
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        if not isinstance(ref, str) or not ref.startswith("#") or ref in seen:
            return None, seen
        seen = seen + (ref,)
        target: Any = root
        for part in ref[1:].split("/"):
            if part == "":
                continue
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return None, seen
            target = target[part]
        extra = {k: v for k, v in node.items() if k != "$ref"}
        node = {**target, **extra} if extra and isinstance(target, dict) else target
    return node, seen


def resolve_ref(node: Any, root: dict[str, Any]) -> Any:
    """`node` with its local $ref chain followed (None for a recursive or unknown reference)."""
    return _resolve(node, root, ())[0]


def _types_of(node: dict[str, Any]) -> list[str]:
    t = node.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if "enum" in node or "const" in node:
        values = node.get("enum", [node.get("const")]) if "enum" in node else [node["const"]]
        kinds = {_json_kind(v) for v in values}
        return sorted(kinds)
    if "properties" in node:
        return ["object"]
    if "items" in node or "prefixItems" in node:
        return ["array"]
    return []


def _json_kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _arrow(node: Any, root: dict[str, Any], seen: tuple[str, ...], depth: int) -> pa.DataType | None:
    if depth > _MAX_DEPTH:
        return None
    node, seen = _resolve(node, root, seen)
    if not isinstance(node, dict):
        return None
    for key in ("anyOf", "oneOf"):
        if key in node:
            branches = [b for b in node[key] if not (isinstance(b, dict) and b.get("type") == "null")]
            types = {str(_arrow(b, root, seen, depth + 1)) for b in branches}
            if len(branches) >= 1 and len(types) == 1:
                return _arrow(branches[0], root, seen, depth + 1)
            return None
    if "allOf" in node and len(node["allOf"]) == 1 and "type" not in node:
        return _arrow(node["allOf"][0], root, seen, depth + 1)
    kinds = [t for t in _types_of(node) if t != "null"]
    if set(kinds) == {"integer", "number"}:
        return pa.float64()
    if len(kinds) != 1:
        return None
    kind = kinds[0]
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        items = node.get("items")
        if not isinstance(items, dict):
            return None
        inner = _arrow(items, root, seen, depth + 1)
        return pa.list_(inner) if inner is not None else None
    if kind == "object":
        props = node.get("properties")
        if not isinstance(props, dict) or not props:  # a free-form object or a map
            return None
        fields = []
        for name, sub in props.items():
            t = _arrow(sub, root, seen, depth + 1)
            fields.append(pa.field(name, t if t is not None else pa.string()))
        return pa.struct(fields)
    return None


def arrow_type_for_schema(schema: dict[str, Any]) -> pa.DataType | None:
    """The Arrow type of values valid against `schema`, or None when it has none (store JSON text).

    Nested parts without a type (e.g. a free-form property) become string fields holding JSON text.
    Extra properties an object allows beyond `properties` are dropped from the struct.
    """
    return _arrow(schema, schema, (), 0)


def to_arrow_value(value: Any, schema: dict[str, Any]) -> Any:
    """Shape a parsed answer for the column typed by arrow_type_for_schema(schema).

    None type -> compact JSON text; struct fields missing from the answer -> null; fields typed as
    string but holding non-strings -> JSON text; integers in float columns -> float.
    """
    return _shape(value, arrow_type_for_schema(schema))


def _shape(value: Any, t: pa.DataType | None) -> Any:
    if value is None:
        return None
    if t is None:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if pa.types.is_struct(t):
        if not isinstance(value, dict):
            return None
        return {t.field(i).name: _shape(value.get(t.field(i).name), t.field(i).type) for i in range(t.num_fields)}
    if pa.types.is_list(t):
        return [_shape(v, t.value_type) for v in value] if isinstance(value, list) else None
    if pa.types.is_string(t):
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    if pa.types.is_floating(t):
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    if pa.types.is_integer(t):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            return None
        return int(value)
    if pa.types.is_boolean(t):
        return value if isinstance(value, bool) else None
    return value
