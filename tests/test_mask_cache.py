"""MaskCache (engine/mask_cache.py) against a reference LRU: what it keeps, what it evicts, and that a
kept key always gives back the row stored for it (the table grows by doubling up to its limit)."""

from __future__ import annotations

from collections import OrderedDict

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.mask_cache import MaskCache, copy_rows

WORDS = 3


def _row(key: int) -> torch.Tensor:
    return torch.tensor([key, -key, key * 7 + 1], dtype=torch.int32)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 9), ops=st.lists(st.tuples(st.sampled_from(["store", "lookup"]),
                                                          st.lists(st.integers(0, 15), min_size=1, max_size=6)),
                                                min_size=1, max_size=40))
def test_lru_against_a_reference(capacity, ops):
    cache = MaskCache(WORDS, capacity * WORDS * 4)
    ref: OrderedDict[int, None] = OrderedDict()
    for op, keys in ops:
        if op == "store":
            mask = torch.stack([_row(k) for k in keys])
            cache.store(keys, mask, list(range(len(keys))))
            for k in keys[:capacity]:
                if k not in ref:
                    if len(ref) == capacity:
                        ref.popitem(last=False)
                    ref[k] = None
        else:
            for k in keys:
                slot = cache.lookup(k)
                assert (slot is not None) == (k in ref)
                if slot is not None:
                    ref.move_to_end(k)
                    out = torch.zeros((1, WORDS), dtype=torch.int32)
                    cache.gather([slot], out, [0])
                    assert torch.equal(out[0], _row(k))
        assert len(cache) == len(ref) <= capacity


def test_off_keeps_nothing():
    cache = MaskCache(WORDS, 0)
    cache.store([1], _row(1)[None], [0])
    assert cache.lookup(1) is None and len(cache) == 0


def test_copy_rows():
    src = torch.arange(12, dtype=torch.int32).reshape(4, 3)
    dst = torch.full((3, 3), -1, dtype=torch.int32)
    copy_rows(dst, [2, 0], src, [1, 3])
    assert dst.tolist() == [[9, 10, 11], [-1, -1, -1], [3, 4, 5]]
