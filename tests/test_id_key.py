"""The canonical id key (batchinfer.io.id_key): one text per id, the same from Python values and
from Arrow arrays, and an output type that holds every id of every source with its key unchanged."""

from __future__ import annotations

import datetime as dt
import math
from decimal import Decimal

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.io.id_key import IdError, IdType, array_keys, common_type, convert_array, key, python_id_type, to_output


# ---- the key itself -------------------------------------------------------------------------------


def test_key_examples():
    assert [key(v) for v in ("a", True, False, 7, -(2**70), 7.0, -0.0, 1e-07, 1e16, 0.1, Decimal("1.50"), Decimal("7"))] == [
        "a", "true", "false", "7", str(-(2**70)), "7", "0", "0.0000001", "10000000000000000", "0.1", "1.5", "7"]
    assert key(dt.datetime(2024, 1, 1)) == "2024-01-01T00:00:00"
    tokyo = dt.timezone(dt.timedelta(hours=9))
    assert key(dt.datetime(2024, 1, 1, 9, tzinfo=tokyo)) == key(dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)) == "2024-01-01T00:00:00+00:00"
    assert key(dt.date(2024, 1, 31)) == "2024-01-31" and key(b"abc") == "abc"
    for bad in (math.nan, math.inf, [1], {"a": 1}, b"\xff", "\udcff"):
        with pytest.raises(IdError):
            key(bad)


ARROW_CASES = [
    (st.integers(-(2**63), 2**63 - 1), pa.int64()),
    (st.integers(-(2**31), 2**31 - 1), pa.int32()),
    (st.integers(0, 2**64 - 1), pa.uint64()),
    (st.booleans(), pa.bool_()),
    (st.text(), pa.string()),
    (st.text(), pa.large_string()),
    (st.floats(allow_nan=False, allow_infinity=False), pa.float64()),
    (st.floats(allow_nan=False, allow_infinity=False, width=32), pa.float32()),
    (st.dates(), pa.date32()),
    (st.datetimes(), pa.timestamp("us")),
    (st.datetimes(timezones=st.just(dt.timezone.utc)), pa.timestamp("us", tz="UTC")),
    (st.decimals(min_value=-(10**8), max_value=10**8, places=3), pa.decimal128(12, 3)),
]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_array_keys_agree_with_key(data):
    """The vectorised form and the Python form are one definition: same text for every value."""
    strategy, typ = data.draw(st.sampled_from(ARROW_CASES))
    values = data.draw(st.lists(st.one_of(st.none(), strategy), max_size=8))
    arr = pa.array(values, typ)
    expect = [None if v is None else key(v) for v in arr.to_pylist()]
    assert array_keys(arr).to_pylist() == expect
    assert array_keys(pa.chunked_array([arr])).to_pylist() == expect



JSON_IDS = st.one_of(st.text(), st.integers(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_common_type_holds_every_source_with_its_key(data):
    """Files of different id types (Parquet columns, JSON values): the common output type holds every id,
    written ids read back (also after a rewrite of an older part) have the key they came with."""
    sources: list[tuple[list, IdType, pa.Array | None]] = []
    for _ in range(data.draw(st.integers(1, 3))):
        if data.draw(st.booleans()):  # a Parquet file (or an older part) with an Arrow id column
            strategy, typ = data.draw(st.sampled_from(ARROW_CASES))
            arr = pa.array(data.draw(st.lists(strategy, min_size=1, max_size=5)), typ)
            big = max((abs(v) for v in arr.to_pylist()), default=0) if pa.types.is_integer(typ) else None
            sources.append((arr.to_pylist(), IdType(typ, big), arr))
        else:  # a JSONL file
            values = data.draw(st.lists(JSON_IDS, min_size=1, max_size=5))
            sources.append((values, python_id_type(values), None))
    common = common_type(t for _, t, _ in sources)
    assert common is not None
    for values, _, arr in sources:
        want = [key(v) for v in values]
        written = pa.array([to_output(v, common.type) for v in values], common.type)
        assert written.null_count == 0 and array_keys(written).to_pylist() == want
        if arr is not None:  # an older part rewritten in the common type keeps its keys
            assert array_keys(convert_array(arr, common.type)).to_pylist() == want


def test_common_type_examples():
    assert common_type([IdType(pa.int32(), 5), IdType(pa.int64(), 2**40)]).type == pa.int64()
    assert common_type([IdType(pa.int64(), 5), IdType(pa.string())]).type == pa.string()
    assert common_type([IdType(pa.int64(), 5), IdType(pa.float64())]).type == pa.float64()
    assert common_type([IdType(pa.int64(), 2**60), IdType(pa.float64())]).type == pa.string()  # would lose digits
    assert common_type([IdType(pa.uint64(), 2**64 - 1), IdType(pa.int8(), 1)]).type == pa.string()
    assert common_type([IdType(pa.timestamp("us")), IdType(pa.timestamp("ns"))]).type == pa.timestamp("ns")
    assert common_type([IdType(pa.timestamp("us")), IdType(pa.timestamp("us", tz="UTC"))]).type == pa.string()
    assert python_id_type([1, 2**70]).type == pa.string() and python_id_type([1, 2.5]).type == pa.float64()


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.decimals(allow_nan=False, allow_infinity=False), st.floats(allow_nan=False, allow_infinity=False), st.integers()))
def test_numeric_keys_are_exact_plain_numbers(v):
    """A number's key is plain decimal text (no exponent) that denotes exactly the same number (every digit
    kept; a float stands for its shortest round-trip text), so equal numbers share a key."""
    k = key(v)
    assert "e" not in k.lower() and (k == "0" or not k.lstrip("-").startswith("0") or k.lstrip("-").startswith("0."))
    if isinstance(v, float):
        assert float(k) == v and Decimal(k) == Decimal(repr(v))
    else:
        assert Decimal(k) == v
    assert key(Decimal(k)) == k
