"""Block allocator: refcounts, the free pool, the prefix hash table, the cache tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.engine.kv_cache import BlockAllocator, allocate_kv_cache, hash_block, kv_block_bytes


def test_allocate_and_free_roundtrip():
    a = BlockAllocator(num_blocks=4, block_size=8)
    blocks = a.allocate(3)
    assert len(set(blocks)) == 3 and a.num_free == 1 and a.num_used == 3
    a.check()
    with pytest.raises(MemoryError):
        a.allocate(2)
    a.free(blocks)
    assert a.num_free == 4
    a.check()
    with pytest.raises(ValueError):
        a.free([blocks[0]])


def test_hash_is_chained():
    h1 = hash_block(None, [1, 2, 3])
    assert hash_block(None, [1, 2, 3]) == h1
    assert hash_block(None, [1, 2, 4]) != h1
    assert hash_block(h1, [5, 6, 7]) != hash_block(hash_block(None, [9, 9, 9]), [5, 6, 7])


def test_shared_block_hash_dropped_when_last_reference_goes():
    a = BlockAllocator(num_blocks=3, block_size=2)
    (b,) = a.allocate(1)
    h = hash_block(None, [1, 2])
    a.register(b, h)
    assert a.lookup(h) == b
    a.share(b)
    assert a.refcounts[b] == 2
    a.free([b])
    assert a.lookup(h) == b  # still in use by one sequence
    a.free([b])
    assert a.lookup(h) is None and a.num_free == 3
    a.check()
    with pytest.raises(ValueError):
        a.share(b)  # free blocks cannot be shared: no retention cache


def test_first_writer_wins_registration():
    a = BlockAllocator(num_blocks=3, block_size=2)
    b1, b2 = a.allocate(2)
    h = hash_block(None, [4, 4])
    a.register(b1, h)
    a.register(b2, h)
    assert a.lookup(h) == b1
    a.free([b2])
    assert a.lookup(h) == b1
    a.check()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_operations_keep_invariants(data):
    n = data.draw(st.integers(1, 12))
    a = BlockAllocator(num_blocks=n, block_size=4)
    held: list[int] = []  # one entry per reference
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["alloc", "share", "free", "register"]))
        if op == "alloc":
            k = data.draw(st.integers(0, 3))
            if k <= a.num_free:
                held += a.allocate(k)
            else:
                with pytest.raises(MemoryError):
                    a.allocate(k)
        elif op == "share" and held:
            b = data.draw(st.sampled_from(held))
            a.share(b)
            held.append(b)
        elif op == "free" and held:
            b = held.pop(data.draw(st.integers(0, len(held) - 1)))
            a.free([b])
        elif op == "register" and held:
            b = data.draw(st.sampled_from(held))
            a.register(b, hash_block(None, [data.draw(st.integers(0, 3))]))
        a.check()
        assert a.num_used == len(set(held))
    a.free(held)
    a.check()
    assert a.num_free == n


def test_cache_tensors_are_views_of_one_allocation():
    caches = allocate_kv_cache(3, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32, device="cpu")
    assert len(caches) == 3
    k0, v0 = caches[0]
    assert k0.shape == (5, 4, 2, 8) and v0.shape == (5, 4, 2, 8)
    base = k0.untyped_storage().data_ptr()
    assert all(k.untyped_storage().data_ptr() == base and v.untyped_storage().data_ptr() == base for k, v in caches)
    for k, v in caches:
        k.zero_()
        v.zero_()
    k0[1, 2].fill_(1.0)
    assert caches[1][0].abs().sum() == 0 and v0.abs().sum() == 0 and k0.sum() == 2 * 8
    assert kv_block_bytes(3, 4, 2, 8, torch.float32) == 2 * 3 * 4 * 2 * 8 * 4


def test_head_major_layout_keeps_each_heads_block_contiguous():
    """kv_cache_layout "head": the same [blocks, block_size, kv_heads, head_dim] view, but one KV
    head's slots of a block lie side by side (block_size x head_dim elements in one run)."""
    caches = allocate_kv_cache(2, num_blocks=5, block_size=4, num_kv_heads=3, head_dim=8, dtype=torch.float32,
                               device="cpu", layout="head")
    k0, v0 = caches[0]
    assert k0.shape == (5, 4, 3, 8) and k0.stride() == (3 * 4 * 8, 8, 4 * 8, 1)
    k0.zero_()
    v0.zero_()
    k0[2, :, 1] = torch.arange(32, dtype=torch.float32).view(4, 8)  # block 2, head 1: every slot
    run = k0[2].permute(1, 0, 2)[1].reshape(-1)  # head 1's run of the block
    assert torch.equal(run, torch.arange(32, dtype=torch.float32)) and k0.sum() == run.sum() and v0.abs().sum() == 0
    with pytest.raises(ValueError, match="layout"):
        allocate_kv_cache(1, 2, 4, 1, 8, torch.float32, "cpu", layout="blocks")


def test_kv_layout_choice_follows_the_attention_backend():
    from batchinfer.engine.config import EngineConfig
    from batchinfer.engine.kv_cache import choose_kv_layout

    assert choose_kv_layout("auto", ("head", "token"), "triton") == "head"
    assert choose_kv_layout("head", ("token", "head"), "triton") == "head"
    with pytest.raises(ValueError, match="torch attention backend"):
        choose_kv_layout("head", ("token",), "torch")
    with pytest.raises(ValueError, match="kv_cache_layout"):
        EngineConfig(model="m", kv_cache_layout="rows")
