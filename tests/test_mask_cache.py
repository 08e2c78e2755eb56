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


@settings(max_examples=80, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)), max_size=12, unique_by=lambda p: p[0]),
       same=st.booleans())
def test_copy_rows_equals_one_indexed_copy(pairs, same):
    """The rows equal one gathered copy made before any write, also within one tensor whose sources
    are targets too."""
    src = torch.arange(8 * WORDS, dtype=torch.int32).reshape(8, WORDS)
    dst = src.clone() if same else torch.full((8, WORDS), -1, dtype=torch.int32)
    rows, sources = [d for d, _ in pairs], [s for _, s in pairs]
    want = dst.clone()
    if rows:
        want[rows] = (dst if same else src)[sources].clone()
    copy_rows(dst, rows, dst if same else src, sources)
    assert torch.equal(dst, want)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(0, 5), min_size=1, max_size=12))
def test_row_masks_gather_the_rows_their_index_names(distinct, index):
    """RowMasks.dense() and .on(device) both give table[index[i]] as row i, whatever rows repeat."""
    from batchinfer.structured.bitmask import RowMasks, apply_token_bitmask_, apply_token_bitmask_torch_

    index = [i % (distinct + 1) for i in index]
    table = torch.randint(-(2**31), 2**31 - 1, (distinct + 1, WORDS), dtype=torch.int32)
    masks = RowMasks(table, torch.tensor(index, dtype=torch.int64))
    want = torch.stack([table[i] for i in index])
    assert masks.shape == tuple(want.shape)
    assert torch.equal(masks.dense(), want)
    assert torch.equal(masks.on(torch.device("cpu")), want)
    logits = torch.randn(len(index), WORDS * 32)
    assert torch.equal(apply_token_bitmask_(logits.clone(), masks), apply_token_bitmask_torch_(logits.clone(), want))


def test_step_table_keeps_slot_zero_all_allowed_and_resets_its_index():
    from batchinfer.engine.grammar import StepTable

    t = StepTable(4, WORDS, pin=False).reset(3)
    slots = [t.new_slot(), t.new_slot()]
    assert slots == [1, 2]
    t.table[slots] = 7
    t.index[[0, 2]] = slots
    dense = t.take().dense()
    assert dense[:, 0].tolist() == [7, -1, 7]
    assert t.take().table.shape[0] == 3  # slot 0 and the two handed out
    t.reset(4)
    assert t.used == 1 and t.index.tolist() == [0, 0, 0, 0]
    assert bool((t.take().dense() == -1).all())
