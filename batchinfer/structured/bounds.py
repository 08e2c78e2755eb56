"""Bounded answers: what a grammar backend compiles is rewritten so that every number it lets the model
write fits the output column, and (opt-in) every string has a length limit.

A JSON schema leaves numbers unbounded (`{"type": "number", "minimum": 0, "maximum": 100000}` still
allows `1.000000000000000…` without end), so a sampled or looping model can spend max_tokens inside
one number. Before compiling, the schema is rewritten to a subset of itself that every backend
bounds natively:

* integer: |n| <= INT_LIMIT (10^18 - 1: fits int64), intersected with the schema's bounds;
* number: an integer |n| <= NUM_INT_LIMIT (17 digits), or a decimal with |x| <= DEC_LIMIT (10^11)
  and at most FRACTION_DIGITS (6) digits after the point: at most 17 significant digits, no
  exponent, so float64 holds it; intersected with the schema's bounds;
* values the schema leaves free ({} / true, extra properties, array items without a schema) are a
  bounded "any JSON" with the same numbers;
* with max_string_length, every string without a maxLength (or with a larger one) gets that one;
* a string of format "date" (and no pattern of its own) gets DATE_PATTERN instead: the libraries'
  date grammars allow February 29 in every year (a random walk wrote "3487-02-29", which the
  validator rightly rejects), the pattern only in leap years, and only the years 0001-9999 that
  the validator's dates have.

xgrammar and llguidance get the rewritten schema (ranges are how both bound digits; llguidance also
needs multipleOf for the fraction digits); outlines-core ignores ranges, so its regex gets bounded
number patterns instead. Whitespace is bounded by the backends' own options (compact: none;
flexible: at most FLEXIBLE_MAX_WHITESPACE characters per gap). Answers are still validated against
the ORIGINAL schema after decoding (validate.py), so the rewrite can only narrow what is accepted.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from batchinfer.structured.base import Constraint, GrammarError

INT_LIMIT = 10**18 - 1
NUM_INT_LIMIT = 10**17 - 1
DEC_LIMIT = 10**11
FRACTION_DIGITS = 6
ANY = "__batchinfer_bounded_any"
BOUNDS_VERSION = "bounds-4"  # part of the grammar disk cache key: change it when the rewrite changes
# RFC 3339 full-date with the Gregorian calendar's month lengths and leap years (capturing groups only:
# every backend's regex dialect has them)
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_MONTH_DAY = "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([2468][048]|[13579][26]|0[48])00)"
DATE_PATTERN = f"^({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)$"

# outlines-core's regex pieces (outlines_core.json_schema.INTEGER / NUMBER) and bounded replacements
OUTLINES_INTEGER = r"(-)?(0|[1-9][0-9]*)"
OUTLINES_NUMBER = r"((-)?(0|[1-9][0-9]*))(\.[0-9]+)?([eE][+-][0-9]+)?"
BOUNDED_INTEGER = r"(-)?(0|[1-9][0-9]{0,17})"
BOUNDED_NUMBER = r"((-)?(0|[1-9][0-9]{0,16})|(-)?(0|[1-9][0-9]{0,10})\.[0-9]{1,6})"

_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# subschemas a value must satisfy (narrowing them narrows the schema); `not` and `if` are left alone:
# narrowing those would widen what the schema accepts
_SUB_ONE = ("additionalProperties", "contains", "then", "else", "propertyNames",
            "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _f64_inward(v: Any, up: bool) -> Any:
    """An integer bound moved inward (up: towards +inf) to the nearest integer a float64 holds exactly.
    Backends read bounds as float64 (llguidance does), where 10^18 - 1 becomes 10^18 and lets a 19-digit
    number through; narrowing a bound past 2^53 by the float's spacing only narrows what is accepted."""
    if not isinstance(v, int) or isinstance(v, bool) or int(float(v)) == v:
        return v
    f = float(v)
    if (int(f) < v) == up:  # rounded outward: take the next float inward
        f = math.nextafter(f, math.inf if up else -math.inf)
    return int(f)


def _band(node: dict[str, Any], kind: str, limit: float, multiple: Any = None) -> dict[str, Any] | None:
    """`node`'s numeric keywords intersected with [-limit, limit] as a `kind` schema; None when empty."""
    out: dict[str, Any] = {"type": kind}
    draft4 = isinstance(node.get("exclusiveMinimum"), bool) or isinstance(node.get("exclusiveMaximum"), bool)
    lo, hi = node.get("minimum"), node.get("maximum")
    xlo, xhi = node.get("exclusiveMinimum"), node.get("exclusiveMaximum")
    if kind == "integer":
        lo = math.ceil(lo) if _num(lo) else lo
        hi = math.floor(hi) if _num(hi) else hi
        limit = int(limit)
    # lower side: the schema's own bound where it is tighter, else -limit
    if _num(xlo) and not draft4 and xlo >= -limit:
        out["exclusiveMinimum"] = xlo
    elif _num(lo) and lo >= -limit:
        out["minimum"] = lo
        if draft4 and xlo is True:
            out["exclusiveMinimum"] = True
    else:
        out["minimum"] = -limit
    if _num(xhi) and not draft4 and xhi <= limit:
        out["exclusiveMaximum"] = xhi
    elif _num(hi) and hi <= limit:
        out["maximum"] = hi
        if draft4 and xhi is True:
            out["exclusiveMaximum"] = True
    else:
        out["maximum"] = limit
    exact = _int_range(out) if kind == "integer" else None
    if kind == "integer":
        for key, up in (("minimum", True), ("exclusiveMinimum", True), ("maximum", False), ("exclusiveMaximum", False)):
            if key in out:
                out[key] = _f64_inward(out[key], up)
    low = out.get("minimum", out.get("exclusiveMinimum"))
    high = out.get("maximum", out.get("exclusiveMaximum"))
    if _num(low) and _num(high) and (low > high or (low == high and ("exclusiveMinimum" in out or "exclusiveMaximum" in out))):
        if exact is not None and exact[0] <= exact[1]:
            # integers there, but no float64 between them: every bound reads as one float (minimum
            # 999999999999999873 with our 10^18 - 1 both read as 10^18), and given as it is, the
            # schema would let a backend write digits without end
            raise GrammarError(
                f"integers from {exact[0]} to {exact[1]} (the schema's range within the output column's "
                f"bound {int(limit)}) cannot be bounded: no number a float64 holds lies inside them, and the "
                "grammar backends read ranges as float64; widen the range or bound it where float64 is exact")
        return None
    if multiple is not None:
        out["multipleOf"] = multiple
    return out


def _int_range(band: dict[str, Any]) -> tuple[int, int] | None:
    """The integers [lo, hi] an integer band allows (its bounds before they are moved to float64s)."""
    lo, hi = band.get("minimum"), band.get("maximum")
    if _num(band.get("exclusiveMinimum")):
        lo = math.floor(band["exclusiveMinimum"]) + 1
    if _num(band.get("exclusiveMaximum")):
        hi = math.ceil(band["exclusiveMaximum"]) - 1
    if not (_num(lo) and _num(hi)):
        return None
    lo, hi = math.ceil(lo), math.floor(hi)
    if band.get("exclusiveMinimum") is True:  # draft 4: a boolean beside the bound
        lo += 1
    if band.get("exclusiveMaximum") is True:
        hi -= 1
    return lo, hi


class _Rewriter:
    def __init__(self, backend: str, max_string_length: int | None) -> None:
        self.backend = backend
        self.max_string_length = max_string_length
        self.numbers = backend != "outlines"  # outlines-core: bounded in its regex instead
        self.used_any = False

    # -- the bounded forms --------------------------------------------------------------------

    def integer(self, node: dict[str, Any]) -> dict[str, Any]:
        band = _band(node, "integer", INT_LIMIT, node.get("multipleOf"))
        if band is None:
            return node
        keep = {k: v for k, v in node.items() if k not in ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")}
        return {**keep, **band}

    def number(self, node: dict[str, Any]) -> dict[str, Any]:
        m = node.get("multipleOf")
        int_multiple = m if _num(m) and float(m).is_integer() else None
        if self.backend.startswith("llguidance"):
            dec_multiple = m if _num(m) else 10.0**-FRACTION_DIGITS
        else:  # xgrammar: its range grammar keeps 6 fraction digits; it ignores multipleOf on numbers
            dec_multiple = None
        bands = [b for b in (_band(node, "integer", NUM_INT_LIMIT, int_multiple), _band(node, "number", DEC_LIMIT, dec_multiple)) if b]
        if not bands:
            return node  # the schema's own bounds are outside ours: leave it as it is
        keep = {k: v for k, v in node.items() if k not in ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")}
        return {**keep, "anyOf": bands} if len(bands) > 1 else {**keep, **bands[0]}

    def string(self, node: dict[str, Any]) -> dict[str, Any]:
        if node.get("format") == "date" and "pattern" not in node:
            node = {**{k: v for k, v in node.items() if k != "format"}, "pattern": DATE_PATTERN}
        n = self.max_string_length
        if n is None or "enum" in node or "const" in node:
            return node
        if isinstance(node.get("maxLength"), int) and node["maxLength"] <= n:
            return node
        if isinstance(node.get("minLength"), int) and node["minLength"] > n:
            return node
        return {**node, "maxLength": n}

    def any_ref(self) -> dict[str, Any]:
        self.used_any = True
        return {"$ref": f"#/$defs/{ANY}"}

    def any_schema(self) -> dict[str, Any]:
        ref = {"$ref": f"#/$defs/{ANY}"}
        return {"anyOf": [
            {"type": "null"}, {"type": "boolean"}, self.number({"type": "number"}), self.string({"type": "string"}),
            {"type": "array", "items": ref}, {"type": "object", "additionalProperties": ref},
        ]}

    # -- the walk -------------------------------------------------------------------------------

    def free(self, node: Any) -> bool:
        """A subschema that allows any JSON value."""
        return node is True or (isinstance(node, dict) and not node)

    def walk(self, node: Any) -> Any:
        if self.free(node):
            return self.any_ref() if self.numbers else node
        if not isinstance(node, dict):
            return node
        node = dict(node)
        for k in _SUB_MAPS:
            if isinstance(node.get(k), dict):
                node[k] = {name: self.walk(sub) for name, sub in node[k].items()}
        for k in _SUB_ONE:
            if k in node and (isinstance(node[k], dict) or node[k] is True):
                if k in ("additionalProperties", "unevaluatedProperties", "additionalItems", "unevaluatedItems") or not self.free(node[k]):
                    node[k] = self.walk(node[k])
        if isinstance(node.get("items"), (dict, bool)):
            node["items"] = self.walk(node["items"])
        elif isinstance(node.get("items"), list):
            node["items"] = [self.walk(x) for x in node["items"]]
        for k in _SUB_LISTS:
            if isinstance(node.get(k), list):
                node[k] = [self.walk(x) for x in node[k]]
        if "enum" in node or "const" in node or "$ref" in node:
            return node
        t = node.get("type")
        if isinstance(t, list):
            if len(t) > 1 and any(x in ("number", "integer", "string", "object", "array") for x in t):
                return {"anyOf": [self.walk({**node, "type": x}) for x in t]}
            t = t[0] if t else None
        if t == "integer" and self.numbers:
            return self.integer(node)
        if t == "number" and self.numbers:
            return self.number(node)
        if t == "string":
            return self.string(node)
        if self.numbers and (t == "object" or "properties" in node) and node.get("additionalProperties", True) is True \
                and "patternProperties" not in node and "unevaluatedProperties" not in node:
            node["additionalProperties"] = self.any_ref()
        if self.numbers and t == "array" and "items" not in node and "prefixItems" not in node:
            node["items"] = self.any_ref()
        return node


def bounded_schema(schema: Any, backend: str, max_string_length: int | None = None) -> Any:
    """The schema `backend` compiles: numbers (and with max_string_length, strings) bounded."""
    r = _Rewriter(backend, max_string_length)
    out = r.walk(copy.deepcopy(schema))
    if r.used_any:
        if not isinstance(out, dict):
            return schema
        defs = dict(out.get("$defs") or {})
        defs[ANY] = r.any_schema()
        out = {**out, "$defs": defs}
    return out


def bounded_constraint(constraint: Constraint, backend: str) -> Constraint:
    """The constraint a backend compiles (json_schema: rewritten, see the module docstring)."""
    if constraint.kind != "json_schema":
        return constraint
    schema = bounded_schema(constraint.schema, backend, constraint.max_string_length)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    if text == constraint.value:
        return constraint
    return Constraint("json_schema", text, constraint.whitespace, constraint.max_string_length)


def bounded_regex(regex: str) -> str:
    """outlines-core's regex for a JSON schema with every number pattern bounded (see the docstring)."""
    return regex.replace(OUTLINES_NUMBER, BOUNDED_NUMBER).replace(OUTLINES_INTEGER, BOUNDED_INTEGER)
