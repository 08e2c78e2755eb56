"""The paged KV cache: a reference-counted block allocator with prefix sharing, and the tensors.

Blocks hold `block_size` tokens of K and V for every layer. A sequence owns a list of block ids
(its block table). Blocks of a common prompt prefix may be shared: each FULL block gets a hash of
its token ids chained with the previous block's hash, and a table hash -> block id remembers the
blocks that are in use right now. There is deliberately no retention cache: when a block's
reference count drops to 0 it goes straight back to the free pool and its hash is forgotten, so
memory is never spent on per-document KV that will not be reused.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence as Seq

import numpy as np
import torch

# How a block's K (or V) is laid out (EngineConfig.kv_cache_layout): "token" [block_size, kv_heads,
# head_dim], "head" [kv_heads, block_size, head_dim]; both are seen as [blocks, block_size, kv_heads,
# head_dim] (the second through strides).
KV_LAYOUTS = ("token", "head")


def hash_block(prev_hash: bytes | None, token_ids: Seq[int]) -> bytes:
    """Hash of one full block: its token ids chained with the hash of the block before it."""
    h = hashlib.blake2b(digest_size=16)
    if prev_hash is not None:
        h.update(prev_hash)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class BlockAllocator:
    """Hands out block ids, counts references, and maps prefix hashes to blocks in use.

    Invariants (checked by `check()` in tests): refcounts are never negative; a block is in the
    free pool iff its refcount is 0; the hash table only points at blocks in use.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refcounts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take n fresh blocks (refcount 1). Raises MemoryError when fewer than n are free."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.refcounts[b] = 1
        return out

    def share(self, block_id: int) -> None:
        """Add a reference to a block in use (prefix sharing)."""
        if self.refcounts[block_id] <= 0:
            raise ValueError(f"block {block_id} is free; only blocks in use can be shared")
        self.refcounts[block_id] += 1

    def free(self, block_ids: Seq[int]) -> None:
        """Drop one reference to each block; a block at 0 returns to the pool and loses its hash."""
        for b in block_ids:
            rc = self.refcounts[b] - 1
            if rc < 0:
                raise ValueError(f"block {b} freed more often than it was taken")
            self.refcounts[b] = rc
            if rc == 0:
                h = self._block_hash[b]
                if h is not None:
                    self._block_hash[b] = None
                    if self._hash_to_block.get(h) == b:
                        del self._hash_to_block[h]
                self._free.append(b)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block in use whose content has this hash, if any."""
        return self._hash_to_block.get(block_hash)

    def register(self, block_id: int, block_hash: bytes) -> None:
        """Record that a block in use is full and its KV is written. First writer wins."""
        if self.refcounts[block_id] <= 0:
            raise ValueError(f"block {block_id} is free and cannot be registered")
        if self._block_hash[block_id] is None and block_hash not in self._hash_to_block:
            self._hash_to_block[block_hash] = block_id
            self._block_hash[block_id] = block_hash

    def check(self) -> None:
        """Assert the allocator's invariants (tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is in the free pool twice"
        for b, rc in enumerate(self.refcounts):
            assert rc >= 0, f"block {b} has refcount {rc}"
            assert (rc == 0) == (b in free), f"block {b}: refcount {rc}, in free pool {b in free}"
        for h, b in self._hash_to_block.items():
            assert self.refcounts[b] > 0 and self._block_hash[b] == h, f"hash table points at free block {b}"


class KVLayoutError(ValueError):
    """engine.kv_cache_layout names a layout the attention backend in use cannot read (a user's setting)."""


def choose_kv_layout(asked: str, backend_layouts: Seq[str], backend_name: str) -> str:
    """The KV cache layout to allocate: `asked` (EngineConfig.kv_cache_layout), or for "auto" the
    attention backend's first choice; a layout the backend cannot read is refused by name."""
    if asked == "auto":
        return backend_layouts[0]
    if asked not in backend_layouts:
        raise KVLayoutError(f"engine.kv_cache_layout {asked!r} is not one the {backend_name} attention backend reads "
                            f"({', '.join(backend_layouts)})")
    return asked


def kv_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers, K and V."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    layout: str = "token",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One tensor [layers, 2, blocks, block_size, kv_heads, head_dim], viewed as (k, v) per layer;
    with layout "head" it is [layers, 2, blocks, kv_heads, block_size, head_dim] and each layer's k
    and v are views of it with that shape's strides permuted into [blocks, block_size, kv_heads,
    head_dim] (kernels that index by strides read either; KV_LAYOUTS).

    Zeroed on GPUs (cheap there; a kernel's masked lanes then never meet NaN garbage). On the CPU it
    is left uninitialised so a large cache costs no time or resident memory until it is used: a slot
    is only ever read after it was written.
    """
    if layout not in KV_LAYOUTS:
        raise ValueError(f"KV cache layout must be one of {KV_LAYOUTS}, not {layout!r}")
    head = layout == "head"
    shape = (num_layers, 2, num_blocks) + ((num_kv_heads, block_size) if head else (block_size, num_kv_heads)) + (head_dim,)
    if torch.device(device).type == "cpu":
        cache = torch.empty(shape, dtype=dtype, device=device)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    if head:
        cache = cache.permute(0, 1, 2, 4, 3, 5)
    return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]
