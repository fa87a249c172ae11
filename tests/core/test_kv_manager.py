"""Block pool and prefix cache accounting (pure logic, no model)."""

import pytest

from pagedllm.sched.kv_manager import BlockPool, KVCacheManager, hash_block
from pagedllm.sched.request import Request
from pagedllm.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams())


def test_pool_take_release_roundtrip():
    pool = BlockPool(8, enable_caching=True)
    blocks = pool.take(5)
    assert pool.num_free == 3 and all(b.ref_cnt == 1 for b in blocks)
    pool.release(list(reversed(blocks)))
    assert pool.num_free == 8
    with pytest.raises(RuntimeError):
        pool.take(9)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([blocks[0]])


def test_allocate_and_free_blocks_per_request():
    kv = KVCacheManager(10, 4, enable_caching=False)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3 and kv.num_free_blocks == 7
    r.num_computed_tokens = 10
    r.append_token(99)
    assert kv.allocate_slots(r, 1) and len(kv.block_ids("a")) == 3  # fits in the third block
    r.num_computed_tokens = 11
    r.append_token(98)
    r.append_token(97)
    assert kv.allocate_slots(r, 2) and len(kv.block_ids("a")) == 4
    assert not kv.allocate_slots(req("b", list(range(30))), 30)  # 8 blocks needed, 6 free: refused, no change
    assert kv.num_free_blocks == 6
    kv.free(r)
    assert kv.num_free_blocks == 10


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(16, 4, enable_caching=True)
    a = req("a", list(range(12)))
    hits, n = kv.get_computed_blocks(a)
    assert n == 0
    assert kv.allocate_slots(a, 12)
    b = req("b", list(range(12)))
    hits, n = kv.get_computed_blocks(b)
    assert n == 8  # 3 full blocks cached, but the last token must be computed -> 2 blocks
    assert [h.block_id for h in hits] == kv.block_ids("a")[:2]
    assert kv.allocate_slots(b, 12 - n, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 2 for i in kv.block_ids("a")[:2])
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16 and kv.pool.num_cached == 3  # freed but still cached
    c = req("c", list(range(13)))
    hits, n = kv.get_computed_blocks(c)
    assert n == 12


def test_cached_block_is_evicted_when_reused_and_collision_is_verified():
    kv = KVCacheManager(3, 4, enable_caching=True)
    a = req("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    kv.free(a)
    assert kv.pool.num_cached == 2
    b = req("b", [7] * 12)
    assert kv.allocate_slots(b, 12)  # takes all 3 blocks, evicting both cached ones
    assert kv.pool.lookup(hash_block(None, list(range(4))), tuple(range(4))) is None
    # a forged hash entry with different tokens is never served
    blk = kv.pool.blocks[kv.block_ids("b")[0]]
    assert kv.pool.lookup(blk.block_hash, (1, 2, 3, 4)) is None


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(4, 4)
    a = req("a", list(range(8)))
    kv.allocate_slots(a, 8)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache() and kv.pool.num_cached == 0
