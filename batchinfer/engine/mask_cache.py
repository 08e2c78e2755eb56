"""Token masks kept by grammar-state key across steps (engine/grammar.py GrammarState).

A mask is a function of the grammar state, and structured/state_keys.py gives states that many rows
reach (inside a bounded string: its opening and character count): once one row's mask for a key is
computed, every later row with that key copies it. The store is one int32 table [rows, words],
grown by doubling up to `max_bytes`; when full, the least recently used key gives up its row.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import torch

FIRST_ROWS = 256  # the table's first size; it doubles as keys come, up to max_bytes


class MaskCache:
    """LRU store of bitmask rows by key. words: int32 words per mask; max_bytes: the table's limit
    (0: nothing is kept)."""

    def __init__(self, words: int, max_bytes: int) -> None:
        self.words = words
        self.capacity = max(0, max_bytes // (4 * words))
        self._table = torch.empty((0, words), dtype=torch.int32)
        self._slot: dict[Hashable, int] = {}  # key -> table row, least recently used first
        self._free: list[int] = []
        self.evicted = 0  # keys that gave up their row to a newer one

    def __len__(self) -> int:
        return len(self._slot)

    def lookup(self, key: Hashable) -> int | None:
        """The table row of `key` (now the most recently used), or None."""
        slot = self._slot.pop(key, None)
        if slot is not None:
            self._slot[key] = slot
        return slot

    def gather(self, slots: list[int], mask: torch.Tensor, rows: list[int]) -> None:
        """mask[rows[k]] = the mask kept in slots[k], in one indexed copy."""
        copy_rows(mask, rows, self._table, slots)

    def store(self, keys: list[Hashable], mask: torch.Tensor, rows: list[int]) -> None:
        """Keep mask[rows[k]] as the mask of keys[k] (keys not already kept; at most `capacity` of
        them, so no row is taken twice in one call)."""
        if not self.capacity or not keys:
            return
        slots: list[int] = []
        src: list[int] = []
        for key, row in zip(keys[: self.capacity], rows):
            if key in self._slot:
                continue
            slot = self._take()
            self._slot[key] = slot
            slots.append(slot)
            src.append(row)
        copy_rows(self._table, slots, mask, src)

    def _take(self) -> int:
        """A free table row: a new one while the table may grow, else the least recently used key's."""
        if not self._free:
            size = len(self._table)
            if size < self.capacity:
                grown = min(self.capacity, max(FIRST_ROWS, 2 * size))
                table = torch.empty((grown, self.words), dtype=torch.int32)
                table[:size] = self._table
                self._table = table
                self._free = list(range(grown - 1, size - 1, -1))
            else:
                oldest = next(iter(self._slot))
                self.evicted += 1
                return self._slot.pop(oldest)
        return self._free.pop()


def copy_rows(dst: torch.Tensor, dst_rows: list[int], src: torch.Tensor, src_rows: list[int]) -> None:
    """dst[dst_rows[k]] = src[src_rows[k]] for CPU tensors, in one indexed copy through numpy: torch's
    indexed copy of int32 rows ran 30x slower on the CPU (128 rows of 4,748 words: 20.9 ms against
    0.65 ms). The sources are read before any row is written, so dst may be src."""
    if dst_rows:
        dst.numpy()[np.asarray(dst_rows)] = src.numpy()[np.asarray(src_rows)]
