"""Sliding-window KV groups (sched/kv_groups.py): the layout, freeing at the window's exact edge, per-group
admission and prefix-cache hits of the hybrid KV manager (pure accounting, no model)."""

import pytest
import torch
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.ref_ops import paged_attention
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_groups import (
    NULL_BLOCK_ID,
    HybridKVCacheManager,
    KVGroupLayout,
    KVGroupSpec,
    plan_kv_groups,
)
from pagedllm.sched.request import Request

GEMMA3_1B = [None if i % 6 == 5 else 512 for i in range(26)]  # 5 local : 1 global, 26 layers


def req(rid, tokens):
    return Request(rid, list(tokens), SamplingParams())


def layout(*windows, size=1):
    return KVGroupLayout(tuple(KVGroupSpec((i,), w) for i, w in enumerate(windows)), size, len(windows))


def test_layout_gemma3_1b_is_vllms_uniform_page_split():
    lay = plan_kv_groups(GEMMA3_1B)
    assert lay.group_size == 4 and lay.num_groups == 7
    assert lay.groups[0] == KVGroupSpec((5, 11, 17, 23), None)  # full attention first
    assert [len(g.layers) for g in lay.groups[1:]] == [4, 4, 4, 4, 4, 2] and all(
        g.sliding_window == 512 for g in lay.groups[1:])
    assert sorted(i for g in lay.groups for i in g.layers) == list(range(26))
    # layer j of every group views tensor j: one block id spans 4 layers
    tensors = [object() for _ in range(4)]
    caches = lay.layer_caches(tensors)
    assert caches[5] is caches[0] is tensors[0] and caches[11] is caches[1] is tensors[1]
    assert caches[25] is tensors[1] and caches[24] is tensors[0]


def test_layout_none_when_every_layer_is_full_and_one_group_when_all_slide():
    assert plan_kv_groups([None] * 4) is None
    lay = plan_kv_groups([8, 8, 8])
    assert lay.num_groups == 1 and lay.group_size == 3 and lay.groups[0].sliding_window == 8
    close = plan_kv_groups([None] * 5 + [8] * 6)  # counts within 25%: the larger size, less splitting
    assert close.group_size == 6 and close.num_groups == 2


def test_window_edge_matches_the_kernels_mask():
    """Blocks freed at ``num_computed`` are exactly those no later query reads under the reference kernel's rule
    ``q_pos - k_pos < W``: the key at ``num_computed - W + 1`` is still read, so its block is kept."""
    W, bs = 8, 4
    for c in range(1, 40):
        kv = HybridKVCacheManager(64, bs, layout(W), enable_caching=False)
        r = req("a", range(c + 1))
        assert kv.allocate_slots(r, c)
        r.num_computed_tokens = c
        assert kv.allocate_slots(r, 1)  # the next query at position c
        table = kv.req_tables["a"][0]
        first_read = c - W + 1  # the oldest key position q = c reads
        for i, b in enumerate(table):
            wholly_before = (i + 1) * bs <= first_read
            assert (b is None) == wholly_before, (c, i)


def test_freed_window_blocks_return_to_the_shared_pool_and_reach_the_other_group():
    W, bs = 8, 4
    kv = HybridKVCacheManager(20, bs, layout(None, W))
    r = req("a", range(41))
    assert kv.allocate_slots(r, 40)  # a 40-token prompt: 10 blocks in each group
    assert kv.num_free_blocks == 0
    r.num_computed_tokens = 40
    assert kv.allocate_slots(r, 1)  # the decode frees 8 window blocks; the full group takes one of them
    assert kv.num_blocks_of_group("a", 1) == 3 and kv.num_blocks_of_group("a", 0) == 11
    assert kv.num_free_blocks == 20 - 14 and kv.num_freed_by_window == 8
    ids = kv.group_block_ids("a")
    assert ids[1][:8] == [NULL_BLOCK_ID] * 8 and len(ids[0]) == len(ids[1]) == 11
    for _ in range(20):  # decoding on: the window group stays bounded by ceil(W / bs) + 1, the full one grows
        r.append_token(7)
        r.num_computed_tokens += 1
        assert kv.allocate_slots(r, 1)
        assert kv.num_blocks_of_group("a", 1) <= -(-W // bs) + 1
    kv.free(r)
    assert kv.num_used_blocks == 0


def test_admission_counts_every_groups_blocks():
    kv = HybridKVCacheManager(12, 4, layout(None, 8))
    assert not kv.allocate_slots(req("a", range(30)), 28)  # 7 + 7 blocks > 12: refused, nothing taken
    assert kv.num_free_blocks == 12 and "a" not in kv.req_tables
    assert kv.allocate_slots(req("b", range(30)), 24)
    assert kv.num_used_blocks == 12


def test_prefix_hit_is_the_min_over_groups_and_null_before_the_window():
    W, bs = 8, 4
    kv = HybridKVCacheManager(64, bs, layout(None, W))
    a = req("a", range(3, 43))  # 40 tokens
    assert kv.allocate_slots(a, 40)
    a.num_computed_tokens = 40
    kv.free(a)
    b = req("b", list(range(3, 43)) + [99, 98, 97])
    hits, n = kv.get_computed_blocks(b)
    assert n == 40  # every block of a's prompt (b computes its 3 new tokens)
    assert all(h is not None for h in hits[0]) and len(hits[0]) == 10
    first = (40 - W + 1) // bs  # the window group needs only the blocks the next query reads
    assert hits[1][:first] == [None] * first and all(h is not None for h in hits[1][first:])
    assert kv.allocate_slots(b, 3, hits)
    assert kv.num_blocks_of_group("b", 1) == 10 - first + 1
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_prefix_hit_after_eviction_falls_back_to_what_every_group_holds():
    """A pool just large enough: while the request decodes, its freed window blocks are reused (evicted), so a
    later prompt sharing the long prefix can only hit where the window group still has its blocks."""
    W, bs = 8, 4
    kv = HybridKVCacheManager(14, bs, layout(None, W))
    a = req("a", range(3, 27))  # 24-token prompt
    assert kv.allocate_slots(a, 24)
    a.num_computed_tokens = 24
    for t in range(16):  # 16 decodes to 40 tokens: the window group's early blocks are freed, then reused
        a.append_token(100 + t)
        assert kv.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    kv.free(a)
    prefix = list(range(3, 27)) + [100 + t for t in range(16)]
    b = req("b", prefix[:24] + [1, 1, 1, 1, 1])  # shares a's first 6 blocks
    hits, n = kv.get_computed_blocks(b)
    full_hits = 0
    while full_hits < 6 and kv._lookup(b, kv._block_hashes(b, 24), full_hits, 0) is not None:
        full_hits += 1
    assert full_hits == 6  # the full group kept all of them
    window = [kv._lookup(b, kv._block_hashes(b, 24), i, 1) is not None for i in range(6)]
    assert not all(window[4:6])  # the window group lost blocks the hit at 24 tokens would read
    assert n < 24 and n % bs == 0
    k = n // bs
    if k:  # a shorter hit, valid in both groups: its window's blocks are cached in the window group
        need = -(-(W - 1) // bs)
        assert all(window[max(0, k - need):k])
    assert kv.allocate_slots(b, 4, hits)
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_group_views_give_each_layer_its_table_and_their_own_extra():
    bt0, bt1 = [[3, 4]], [[0, 5]]
    meta = AttentionMetadata.build([1], [6], bt0, 4)
    meta.kv_group_tables = [(torch.tensor(bt0, dtype=torch.int32), torch.tensor([17])),
                            (torch.tensor(bt1, dtype=torch.int32), torch.tensor([21]))]
    meta.extra["plan"] = "step"
    v1 = meta.for_kv_group(1)
    assert v1 is meta.for_kv_group(1) and v1.kv_group_tables is None and v1.for_kv_group(0) is v1
    assert v1.block_tables.tolist() == bt1 and v1.slot_mapping.tolist() == [21] and v1.extra == {"plan": "step"}
    v1.extra["cached"] = 1  # a backend's per-step plan of one group's table stays in that group's view
    assert "cached" not in meta.for_kv_group(0).extra
    # a null entry (block 0) is never read: the window masks it, whatever block 0 holds (the reference kernel)
    cache = torch.randn(2, 6, 4, 1, 8)
    q = torch.randn(1, 2, 8)
    out = paged_attention(q, cache, AttentionMetadata.build([1], [6], [[0, 5]], 4), 1.0, sliding_window=2)
    cache[:, 0] = 1e4 * torch.randn(2, 4, 1, 8)
    again = paged_attention(q, cache, AttentionMetadata.build([1], [6], [[0, 5]], 4), 1.0, sliding_window=2)
    assert torch.equal(out, again)
    cache[:, 0] = float("nan")  # a never-written block of an uninitialised pool
    assert torch.equal(out, paged_attention(q, cache, AttentionMetadata.build([1], [6], [[0, 5]], 4), 1.0,
                                            sliding_window=2))


def test_free_and_trim_release_every_group():
    kv = HybridKVCacheManager(32, 4, layout(None, 8, 12))
    r = req("a", range(20))
    assert kv.allocate_slots(r, 20)
    assert kv.num_used_blocks == 15
    kv.trim(r, 10)
    assert kv.num_used_blocks == 9
    kv.free(r)
    assert kv.num_used_blocks == 0 and kv.num_blocks_of("a") == 0
    with pytest.raises(RuntimeError, match="connector"):
        kv.allocate_slots(req("b", range(9)), 1, (), num_external_tokens=4)


@pytest.mark.parametrize("segments", [1, 2])
def test_triton_attention_never_reads_a_freed_window_block(segments):
    """The portable Triton kernel (interpreted on the CPU; the cuda/rocm/xpu plugins run it) with null entries
    (block 0, here never written: NaN) before the window: a tile that starts before the window must not load them."""
    pytest.importorskip("triton")
    from pagedllm.backend.triton.attention import paged_attention as triton_attention

    bs, w = 8, 9
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 8, bs, 1, 32, generator=gen)
    cache[:, 0] = float("nan")
    # a decode at 40 tokens (keys from 31: blocks 3, 4) and a 12-token chunk after 28 (keys from 20: blocks 2-4)
    meta = AttentionMetadata.build([1, 12], [40, 40], [[0, 0, 0, 3, 4], [0, 0, 5, 6, 7]], bs)
    q = torch.randn(13, 2, 32, generator=gen)
    want = paged_attention(q, cache, meta, 32 ** -0.5, sliding_window=w)
    got = triton_attention(q, cache, meta, 32 ** -0.5, w, num_segments=segments)
    assert not torch.isnan(want).any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
