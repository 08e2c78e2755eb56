"""The canonical key of an id, and the output type of the id column.

Resume compares ids, so both sides — the input rows (Python values from json.loads or Parquet's
to_pylist) and the committed parts (Arrow arrays) — go through ONE definition, `key(value)`:

  str              itself (a lone surrogate, which no UTF-8 file can hold, is an IdError)
  bool             "true" / "false"
  int              decimal digits, any width: "-12", "18446744073709551617"
  float, Decimal   the number in plain decimal notation, without exponent or trailing zeros: a float
                   stands for its shortest round-trip text (0.1 is "0.1", 1e-07 is "0.0000001",
                   1e16 is "10000000000000000"); integral values print as integers, so 3, 3.0 and
                   Decimal("3.00") are one id, and -0.0 is "0". NaN and infinities are IdErrors.
  datetime         ISO 8601: naive "2024-01-31T10:00:00" (".ffffff" or nanoseconds when not 0);
                   with a time zone, the instant in UTC: "2024-01-31T09:00:00+00:00"
  date, time       ISO 8601: "2024-01-31", "10:00:00"
  bytes            the UTF-8 text they hold (invalid UTF-8 is an IdError)
  anything else    (lists, maps, durations) an IdError

`array_keys` is the same function over an Arrow array (vectorised for strings, integers and
booleans, where Arrow's cast prints exactly what `key` prints; tests check the two agree).

The output id column gets `common_type` of every source's id type (each input file, the committed
parts): equal types stay, integers widen, floats with small integers become float64, timestamps take
the finer unit, and anything that does not fit one Arrow type becomes string holding the canonical
key. `to_output` turns an input id into a value of that type, always with the same key.
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

FLOAT_EXACT_INT = 2**53  # integers up to this size are exact in a float64


class IdError(ValueError):
    """A value that cannot be an id (NaN, a list, invalid UTF-8...); the row is rejected."""


def _plain(d: Decimal) -> str:
    """Plain decimal notation without trailing zeros, exact (no rounding to a context's precision)."""
    if not d.is_finite():
        raise IdError(f"{d} is not a finite number")
    sign, digits, exp = d.as_tuple()
    ds = list(digits)
    while len(ds) > 1 and ds[-1] == 0 and exp < 0:  # type: ignore[operator]
        ds.pop()
        exp += 1  # type: ignore[operator]
    if not any(ds):
        return "0"
    text = "".join(map(str, ds)).lstrip("0") or "0"
    if exp >= 0:  # type: ignore[operator]
        text += "0" * exp  # type: ignore[operator]
    else:
        k = -exp  # type: ignore[operator]
        text = text[:-k] + "." + text[-k:] if len(text) > k else "0." + "0" * (k - len(text)) + text
    return ("-" if sign else "") + text


def key(value: Any) -> str:
    """The canonical text of one id (see the module docstring). Raises IdError for unusable values."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise IdError("is not valid Unicode (it holds a lone surrogate)") from None
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise IdError(f"{value!r} is not a finite number")
        return _plain(Decimal(repr(value)))
    if isinstance(value, Decimal):
        try:
            return _plain(value)
        except InvalidOperation:
            raise IdError(f"{value} is not a finite number") from None
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None and value.utcoffset() is not None:
            value = value.astimezone(dt.timezone.utc)
        return value.isoformat()
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:
            raise IdError(f"is not valid UTF-8 (byte {e.start})") from None
    raise IdError(f"is a {type(value).__name__}, not a scalar id")


def key_or_none(value: Any) -> str | None:
    """key(value), or None for a null or unusable id."""
    if value is None:
        return None
    try:
        return key(value)
    except IdError:
        return None


def _fast(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t) or pa.types.is_boolean(t)


def array_keys(arr: pa.Array | pa.ChunkedArray) -> pa.Array:
    """key() of every value of an Arrow array, as a string array (null where the id is null or unusable)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.dictionary_decode()
        t = arr.type
    if getattr(pa.types, "is_string_view", lambda _: False)(t):
        arr = arr.cast(pa.string())
        t = arr.type
    if _fast(t):
        return arr.cast(pa.string())
    return pa.array([key_or_none(v) for v in arr.to_pylist()], pa.string())


# ---- the output column's type -----------------------------------------------------------------------


@dataclass(frozen=True)
class IdType:
    """The Arrow type of one source's ids, and the largest |integer| among them (None: not known)."""

    type: pa.DataType
    int_abs_max: int | None = None
    where: str = ""


_SIGNED = [pa.int8(), pa.int16(), pa.int32(), pa.int64()]
_UNSIGNED = [pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64()]
_UNIT_ORDER = ["s", "ms", "us", "ns"]


def normalize_type(t: pa.DataType) -> pa.DataType:
    """The type an id column of type t is compared as (dictionaries decoded, string kinds unified)."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t):
        return pa.string()
    if pa.types.is_large_binary(t) or getattr(pa.types, "is_binary_view", lambda _: False)(t):
        return pa.binary()
    if pa.types.is_floating(t):
        return pa.float64()
    if pa.types.is_date(t):
        return pa.date32()
    return t


def python_id_type(values: Iterable[Any], where: str = "") -> IdType | None:
    """The id type of JSON values (str, bool, int of any width, float); None when there are none."""
    kinds: set[str] = set()
    big = 0
    for v in values:
        if isinstance(v, bool):
            kinds.add("bool")
        elif isinstance(v, int):
            kinds.add("int")
            big = max(big, abs(v))
        elif isinstance(v, float):
            kinds.add("float")
        else:
            kinds.add("str")
    if not kinds:
        return None
    if kinds == {"str"}:
        return IdType(pa.string(), None, where)
    if kinds == {"bool"}:
        return IdType(pa.bool_(), None, where)
    if kinds == {"int"}:
        return IdType(pa.int64() if big < 2**63 else pa.string(), big, where)
    if kinds <= {"int", "float"}:
        return IdType(pa.float64() if big <= FLOAT_EXACT_INT else pa.string(), big, where)
    return IdType(pa.string(), None, where)


def _int_union(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    if a in _SIGNED and b in _SIGNED:
        return max(a, b, key=_SIGNED.index)
    if a in _UNSIGNED and b in _UNSIGNED:
        return max(a, b, key=_UNSIGNED.index)
    u, s = (a, b) if a in _UNSIGNED else (b, a)
    if u == pa.uint64():
        return None
    return pa.int64() if s == pa.int64() or u == pa.uint32() else max(s, _SIGNED[_UNSIGNED.index(u) + 1], key=_SIGNED.index)


def _union(a: IdType, b: IdType) -> IdType:
    ta, tb = a.type, b.type
    big = max(a.int_abs_max or 0, b.int_abs_max or 0) if (a.int_abs_max is not None or b.int_abs_max is not None) else None
    if ta == tb:
        return IdType(ta, big)
    if pa.types.is_null(ta):
        return b
    if pa.types.is_null(tb):
        return a
    if pa.types.is_integer(ta) and pa.types.is_integer(tb):
        t = _int_union(ta, tb)
        return IdType(t if t is not None else pa.string(), big)
    if {ta, tb} <= {pa.float64()} | set(_SIGNED) | set(_UNSIGNED) and pa.float64() in (ta, tb):
        ints = b if ta == pa.float64() else a
        known = ints.int_abs_max
        fits = known is not None and known <= FLOAT_EXACT_INT or ints.type in (pa.int8(), pa.int16(), pa.int32(), pa.uint8(), pa.uint16(), pa.uint32())
        return IdType(pa.float64() if fits else pa.string(), big)
    if pa.types.is_timestamp(ta) and pa.types.is_timestamp(tb) and ta.tz == tb.tz:
        unit = max(ta.unit, tb.unit, key=_UNIT_ORDER.index)
        return IdType(pa.timestamp(unit, ta.tz), big)
    if pa.types.is_decimal(ta) and pa.types.is_decimal(tb):
        scale = max(ta.scale, tb.scale)
        digits = max(ta.precision - ta.scale, tb.precision - tb.scale) + scale
        return IdType(pa.decimal128(digits, scale) if digits <= 38 else pa.string(), big)
    return IdType(pa.string(), big)


def common_type(sources: Iterable[IdType]) -> IdType | None:
    """The one output type that holds the ids of every source (see the module docstring)."""
    out: IdType | None = None
    for s in sources:
        s = IdType(normalize_type(s.type), s.int_abs_max, s.where)
        out = s if out is None else _union(out, s)
    return out


def to_output(value: Any, typ: pa.DataType) -> Any:
    """An input id as a value of the output column's type (same key). None stays None."""
    if value is None:
        return None
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        return key(value)
    if pa.types.is_floating(typ) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if pa.types.is_binary(typ) and isinstance(value, str):
        return value.encode("utf-8")
    return value


def convert_array(arr: pa.Array | pa.ChunkedArray, typ: pa.DataType) -> pa.Array:
    """A committed part's id column in a wider output type (to rewrite old parts; keys are kept)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    if pa.types.is_string(typ):
        return array_keys(arr)
    try:
        return arr.cast(typ, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.array([to_output(v, typ) for v in arr.to_pylist()], typ)
