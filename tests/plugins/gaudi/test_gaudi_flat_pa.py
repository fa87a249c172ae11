"""The Gaudi plugin's flat-block paged attention and KV-cache ops against core's reference ops (pure torch: these
modules import nothing from habana_frameworks, so they run here without the simulation)."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import KVCacheSpec
from pagedllm_gaudi import flat_pa, kv_cache

BS = 128
KV_HEADS = 2


def _batch(query_lens, seq_lens, gen, spare=3, pad_to=None):
    """Randomly placed blocks; every context token written through the plugin's write_kv and into a canonical
    reference cache; unwritten slots NaN in both. ``pad_to=(tokens, seqs, width)`` pads like core's static runner
    (padding tokens to a sink slot, padding sequences with seq_len 0)."""
    needed = [-(-s // BS) for s in seq_lens]
    nb = sum(needed) + spare
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, k = [], 0
    for n in needed:
        tables.append(perm[k:k + n])
        k += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BS)
    slots = torch.tensor([bt[p // BS] * BS + p % BS for bt, s in zip(tables, seq_lens) for p in range(s)])
    return meta, tables, nb, slots


def _fill(nb, slots, head_size, dtype, gen):
    n = slots.shape[0]
    key = torch.randn(n, KV_HEADS, head_size, generator=gen).to(dtype)
    value = torch.randn(n, KV_HEADS, head_size, generator=gen).to(dtype)
    (ours,) = kv_cache.allocate(KVCacheSpec(1, nb, BS, KV_HEADS, head_size, dtype, "cpu"), torch.device("cpu"))
    ours[0].fill_(float("nan"))
    ours[1].fill_(float("nan"))
    kv_cache.write_kv(key, value, ours, slots)
    ref = torch.full((2, nb, BS, KV_HEADS, head_size), float("nan"), dtype=dtype)
    ref_ops.write_kv(key, value, ref, slots)
    return ours, ref


CASES = {
    # decodes whose contexts end just before, on and after block boundaries, one 9 blocks long
    "decode": ([1, 1, 1, 1], [BS - 1, BS, BS + 1, 8 * BS + 5]),
    # chunked prefill after cached context spanning blocks, mixed with decodes (decodes first)
    "mixed": ([1, 1, 7, BS + 3], [2 * BS + 1, 3 * BS, BS + 9, 2 * BS + 30]),
    "prefill": ([3, 2 * BS + 5], [3, 2 * BS + 5]),
}


@pytest.mark.parametrize("dtype,gqa,head_size", [(torch.float32, 1, 64), (torch.float32, 3, 80),
                                                 (torch.bfloat16, 4, 128), (torch.float32, 2, 16)])
@pytest.mark.parametrize("scenario", sorted(CASES))
def test_flat_pa_matches_reference_across_blocks_of_128(scenario, dtype, gqa, head_size):
    gen = torch.Generator().manual_seed(hash((scenario, gqa, head_size)) % 2**31)
    meta, _, nb, slots = _batch(*CASES[scenario], gen)
    ours, ref = _fill(nb, slots, head_size, dtype, gen)
    query = torch.randn(meta.num_tokens, KV_HEADS * gqa, head_size, generator=gen).to(dtype)
    scale = head_size ** -0.5
    got = flat_pa.paged_attention(query, ours[0], ours[1], meta, scale, None, None)
    want = ref_ops.paged_attention(query, ref, meta, scale)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("window,cap", [(BS // 2 + 3, None), (None, 1.5), (2 * BS + 7, 2.0)])
def test_flat_pa_sliding_window_and_soft_cap(window, cap):
    gen = torch.Generator().manual_seed(7)
    meta, _, nb, slots = _batch(*CASES["mixed"], gen)
    ours, ref = _fill(nb, slots, 64, torch.float32, gen)
    query = 3 * torch.randn(meta.num_tokens, 2 * KV_HEADS, 64, generator=gen)
    got = flat_pa.paged_attention(query, ours[0], ours[1], meta, 0.125, window, cap)
    torch.testing.assert_close(got, ref_ops.paged_attention(query, ref, meta, 0.125, window, cap),
                               atol=1e-4, rtol=1e-4)


def test_flat_pa_under_static_padding_reads_only_real_rows():
    """Padded as core's static runner pads (tokens to a bucket, padding sequences with seq_len 0 and an empty query
    range, block table widened with block 0): real rows equal the reference, padding rows stay finite."""
    gen = torch.Generator().manual_seed(11)
    qlens, slens = [1, 1, BS + 3], [BS + 2, 2 * BS, 2 * BS + 30]
    meta, tables, nb, slots = _batch(qlens, slens, gen)
    ours, ref = _fill(nb, slots, 64, torch.float32, gen)
    ours[0][0].nan_to_num_(0.0)  # padding rows read slot 0 of block 0: finite in the engine (zero-filled pool)
    ours[1][0].nan_to_num_(0.0)
    t_pad, s_pad, w_pad = 256, 4, 4
    qsl = meta.query_start_loc.tolist()
    padded = AttentionMetadata(
        query_start_loc=torch.tensor(qsl + [qsl[-1]] * (s_pad - 3), dtype=torch.int32),
        seq_lens=torch.tensor(slens + [0] * (s_pad - 3), dtype=torch.int32),
        block_tables=torch.nn.functional.pad(meta.block_tables, (0, w_pad - meta.block_tables.shape[1],
                                                                 0, s_pad - 3)),
        slot_mapping=torch.cat([meta.slot_mapping, torch.zeros(t_pad - meta.num_tokens, dtype=torch.int64)]),
        max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, num_decodes=2, block_size=BS,
        query_start_loc_cpu=qsl, seq_lens_cpu=slens)
    query = torch.randn(t_pad, 2 * KV_HEADS, 64, generator=gen)
    got = flat_pa.paged_attention(query, ours[0], ours[1], padded, 0.125, None, None)
    want = ref_ops.paged_attention(query[:meta.num_tokens], ref, meta, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:meta.num_tokens], want, atol=1e-4, rtol=1e-4)


def test_flat_metadata_matches_vllm_gaudi_definitions():
    """block_list / block_groups / block_mapping / bias as vllm-gaudi defines them, one row per query token."""
    meta = AttentionMetadata.build([1, 2], [BS + 1, 2], [[4, 7], [2]], BS)
    fm = flat_pa.flat_metadata(meta, 3)
    assert fm.block_list.tolist() == [4, 7, 2, 0, 2, 0]  # width 2: row 1 and 2 pad their table with block 0
    assert fm.block_groups.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(fm.block_mapping, torch.nn.functional.one_hot(fm.block_groups, 3).float())
    visible = (~fm.block_masked).sum(1).tolist()
    assert visible == [BS, 1, 1, 0, 2, 0]  # usage: full block, last block's used slots, causal within the chunk


def test_write_kv_index_copy_skips_minus_one_and_writes_the_sink():
    gen = torch.Generator().manual_seed(5)
    nb, n = 4, 9
    slots = torch.tensor([5, -1, 130, -1, 0, 511, -1, 260, 3])
    key, value = torch.randn(n, KV_HEADS, 16, generator=gen), torch.randn(n, KV_HEADS, 16, generator=gen)
    (ours,) = kv_cache.allocate(KVCacheSpec(1, nb, BS, KV_HEADS, 16, torch.float32, "cpu"), torch.device("cpu"))
    for t in ours:
        t.fill_(float("nan"))
    kv_cache.write_kv(key, value, ours, slots)
    ref = torch.full((2, nb, BS, KV_HEADS, 16), float("nan"))
    ref_ops.write_kv(key, value, ref, slots)
    torch.testing.assert_close(kv_cache.gather(ours, torch.arange(nb)), ref, equal_nan=True, atol=0, rtol=0)
    all_pad = torch.full((3,), -1)
    before = kv_cache.gather(ours, torch.arange(nb)).clone()
    kv_cache.write_kv(key[:3], value[:3], ours, all_pad)
    torch.testing.assert_close(kv_cache.gather(ours, torch.arange(nb)), before, equal_nan=True, atol=0, rtol=0)


def test_swap_blocks_match_reference():
    gen = torch.Generator().manual_seed(9)
    spec = KVCacheSpec(2, 6, BS, KV_HEADS, 16, torch.float32, "cpu")
    dev = kv_cache.allocate(spec, torch.device("cpu"))
    for c in dev:
        for t in c:
            t.copy_(torch.randn(t.shape, generator=gen))
    host = kv_cache.allocate(KVCacheSpec(2, 3, BS, KV_HEADS, 16, torch.float32, "cpu"), torch.device("cpu"))
    kv_cache.swap_blocks(dev, host, torch.tensor([5, 2]), torch.tensor([0, 2]))
    for c, h in zip(dev, host):
        assert torch.equal(kv_cache.gather(h, torch.tensor([0, 2])), kv_cache.gather(c, torch.tensor([5, 2])))


def test_kernel_modules_import_nothing_from_the_vendor():
    assert not any(m.startswith("habana_frameworks") for m in sys.modules)
