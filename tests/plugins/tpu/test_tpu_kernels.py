"""The TPU plugin's JAX functions, run for real through XLA on JAX's CPU device, against core's pure-torch reference
ops and core's torch model: ragged paged attention, the KV scatter, block copy/swap, the allocator's accounting, the
whole JAX forward, and the jnp sampler. Verified on XLA CPU, not verified on TPU hardware.

The attention, write_kv, gather/copy and fused-op hooks are also run by core's conformance suite
(``test_tpu_e2e.py::test_conformance_applicable_cases``); what the suite cannot check on a cache that is not a torch
tensor (allocator bytes, swap, the step program vs an eager run) is checked here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import KVCacheSpec

PAGE = 16


@pytest.fixture(autouse=True)
def xla_cpu(monkeypatch):
    """Opt into JAX's CPU device for this module (the probe and device choice read it; nothing else changes)."""
    from pagedllm_tpu import mesh, platform

    monkeypatch.setenv(platform.PLATFORM_ENV, "cpu")
    platform.device.cache_clear()
    mesh.mesh.cache_clear()
    yield
    platform.device.cache_clear()
    mesh.mesh.cache_clear()


def _plugin():
    from pagedllm_tpu import plugin

    return plugin


def _spec(num_blocks: int, head_size: int = 32, kv_heads: int = 2, layers: int = 1, dtype=torch.float32):
    return KVCacheSpec(layers, num_blocks, PAGE, kv_heads, head_size, dtype, torch.device("cpu"))


def _random_tables(gen: torch.Generator, seq_lens: list[int], num_blocks: int) -> list[list[int]]:
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, k = [], 0
    for s in seq_lens:
        n = -(-s // PAGE)
        tables.append(perm[k:k + n])
        k += n
    return tables


def _filled(gen, seq_lens, num_blocks, head_size, kv_heads, dtype=torch.float32):
    """A JAX cache and a canonical reference cache with every context slot written through the hooks."""
    p = _plugin()
    tables = _random_tables(gen, seq_lens, num_blocks)
    slots = torch.tensor([t[i // PAGE] * PAGE + i % PAGE for t, s in zip(tables, seq_lens) for i in range(s)])
    k = torch.randn(len(slots), kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(len(slots), kv_heads, head_size, generator=gen).to(dtype)
    (cache,) = p.pagedllm_allocate_kv_cache(_spec(num_blocks, head_size, kv_heads, dtype=dtype))
    p.pagedllm_write_kv(k, v, cache, slots)
    ref = torch.full((2, num_blocks, PAGE, kv_heads, head_size), float("nan"), dtype=dtype)
    ref_ops.write_kv(k, v, ref, slots)
    return cache, ref, tables


@pytest.mark.parametrize("window,cap", [(None, None), (PAGE + 5, None), (None, 2.0)])
def test_ragged_paged_attention_matches_reference_with_static_padding(window, cap):
    """Decodes then prefill chunks after cached context, crossing several pages, GQA 3; then the same batch padded
    the way the runner pads it (extra tokens, empty sequences, wider page table): the real rows must not change."""
    import jax

    from pagedllm_tpu import kv_cache as kvc
    from pagedllm_tpu.attention import ragged_paged_attention

    gen = torch.Generator().manual_seed(0)
    hs, kvh, g = 32, 2, 3
    qlens, lens = [1, 1, 7, 2 * PAGE + 3], [PAGE + 1, 4 * PAGE + 2, 2 * PAGE + 9, 3 * PAGE + 5]
    cache, ref_cache, tables = _filled(gen, lens, 20, hs, kvh)
    meta = AttentionMetadata.build(qlens, lens, tables, PAGE)
    q = torch.randn(sum(qlens), kvh * g, hs, generator=gen) * 2
    want = ref_ops.paged_attention(q, ref_cache, meta, hs ** -0.5, window, cap)
    got = _plugin().pagedllm_paged_attention(q, cache, meta, hs ** -0.5, window, cap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)

    t_pad, s_pad, w_pad = 64, 8, 8
    qp = torch.cat([q, torch.randn(t_pad - q.shape[0], kvh * g, hs, generator=gen)])
    cu = meta.query_start_loc_cpu + [meta.query_start_loc_cpu[-1]] * (s_pad - 4)
    bt = np.zeros((s_pad, w_pad), np.int32)
    bt[:4, : meta.block_tables.shape[1]] = meta.block_tables.numpy()
    fn = jax.jit(lambda *a: ragged_paged_attention(*a, sm_scale=hs ** -0.5, sliding_window=window, soft_cap=cap))
    out = fn(kvc.to_jax(qp), cache.array, np.array(lens + [0] * (s_pad - 4), np.int32), bt, np.array(cu, np.int32))
    out = kvc.to_torch(out)
    assert bool(torch.isfinite(out).all())  # padding rows are finite garbage, the NaN pool never leaks
    torch.testing.assert_close(out[: q.shape[0]], want, atol=2e-5, rtol=2e-5)


def test_write_kv_drops_negative_slots_and_keeps_unwritten_slots_nan():
    p = _plugin()
    gen = torch.Generator().manual_seed(1)
    (cache,) = p.pagedllm_allocate_kv_cache(_spec(4))
    slots = torch.tensor([5, -1, 63, 17, -1, 0])
    k, v = torch.randn(6, 2, 32, generator=gen), torch.randn(6, 2, 32, generator=gen)
    p.pagedllm_write_kv(k, v, cache, slots)
    ref = torch.full((2, 4, PAGE, 2, 32), float("nan"))
    ref_ops.write_kv(k, v, ref, slots)
    got = p.pagedllm_gather_kv_blocks(cache, torch.arange(4))
    torch.testing.assert_close(got, ref, equal_nan=True, atol=0, rtol=0)
    # tpu-inference's combined-head layout: K of head h at 2h, V at 2h + 1.
    page = np.asarray(cache.array)[0, 5]
    np.testing.assert_array_equal(page[0::2], k[0].numpy())
    np.testing.assert_array_equal(page[1::2], v[0].numpy())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocator_bytes_match_the_spec(dtype):
    """What conformance's allocate_kv_cache case checks, for a cache that is not a torch tensor."""
    p = _plugin()
    spec = _spec(7, head_size=48, kv_heads=3, layers=3, dtype=dtype)
    caches = p.pagedllm_allocate_kv_cache(spec)
    assert len(caches) == 3
    assert sum(c.nbytes for c in caches) == 7 * spec.bytes_per_block
    for c in caches:
        assert c.shape == (7, PAGE, 6, 48) and np.dtype(c.dtype).name == str(dtype).removeprefix("torch.")
        got = p.pagedllm_gather_kv_blocks(c, torch.arange(7))
        assert tuple(got.shape) == (2, 7, PAGE, 3, 48) and got.dtype == dtype and bool(got.isnan().all())


def test_swap_blocks_match_reference():
    """Device -> host -> device swaps in the device layout (the suite's swap case needs torch caches); every other
    block untouched. Odd counts exercise the power-of-two index padding."""
    p = _plugin()
    gen = torch.Generator().manual_seed(2)
    caches, refs = [], []
    for _ in range(2):
        c, r, _ = _filled(gen, [5 * PAGE + 7], 7, 32, 2)
        caches.append(c)
        refs.append(r)
    host = p.pagedllm_allocate_host_kv_cache(_spec(4, layers=2), False)
    ref_host = [torch.full((2, 4, PAGE, 2, 32), float("nan")) for _ in range(2)]
    out_src, out_dst, in_src, in_dst = (torch.tensor(x) for x in ([1, 4, 6], [3, 0, 2], [3, 0, 2], [5, 0, 4]))
    p.pagedllm_swap_kv_blocks(caches, host, out_src, out_dst)
    p.pagedllm_swap_kv_blocks(host, caches, in_src, in_dst)
    ref_ops.swap_kv_blocks(refs, ref_host, out_src, out_dst)
    ref_ops.swap_kv_blocks(ref_host, refs, in_src, in_dst)
    for c, r in zip(caches, refs):
        torch.testing.assert_close(p.pagedllm_gather_kv_blocks(c, torch.arange(7)), r, equal_nan=True, atol=0,
                                   rtol=0)


@pytest.mark.parametrize("name", ["llama", pytest.param("qwen3", marks=pytest.mark.slow),
                                  pytest.param("qwen2_swa", marks=pytest.mark.slow)])
def test_jax_forward_matches_core_torch_model(tiny_model_dirs, ref_backend, name):
    """The jitted JAX forward (weights taken from core's loaded model) vs core's torch CausalLM on reference ops,
    over two steps — prefill chunks, then decodes mixed with a chunk after cached context — with the JAX batch padded
    to a bucket (padding writes to a sink page): hidden states close, KV pages equal to the reference's writes."""
    import jax

    from pagedllm.models import load_model
    from pagedllm_tpu import model as jmodel

    model = load_model(tiny_model_dirs[name], backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    spec, params = jmodel.params_from_torch(model, torch.float32)
    nb = 12
    sink = nb  # one page more, never handed out: the padding sink
    ref_kv = ref_ops.allocate_kv_cache(model.num_layers, nb + 1, PAGE, model.num_kv_heads, model.head_size,
                                       torch.float32, "cpu")
    for c in ref_kv:
        c.fill_(float("nan"))
    jax_kv = _plugin().pagedllm_allocate_kv_cache(_spec(nb + 1, model.head_size, model.num_kv_heads,
                                                        model.num_layers))
    model.kv_caches = ref_kv
    fwd = jax.jit(lambda kv, *a: jmodel.forward(spec, params, kv, *a))
    gen = torch.Generator().manual_seed(3)
    tables = [[3, 7, 1], [0, 9, 4, 11], [2, 8]]
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (2 * PAGE + 4, 3 * PAGE + 6, PAGE + 9)]
    # step 1: first chunks; step 2: two decodes (after their whole prompt) and the rest of the third prompt.
    steps = [([20, 35, 10], [20, 35, 10], [p[:n] for p, n in zip(prompts, (20, 35, 10))]),
             ([1, 1, PAGE - 1], [21, 36, PAGE + 9], [prompts[0][20:21], prompts[1][35:36], prompts[2][10:]])]
    for qlens, lens, toks in steps:
        meta = AttentionMetadata.build(qlens, lens, tables, PAGE)
        ids = torch.tensor([t for ts in toks for t in ts])
        pos = torch.tensor([p for q, s in zip(qlens, lens) for p in range(s - q, s)])
        with torch.inference_mode():
            want = model(ids, pos, meta)
        t, s, w = 128, 8, 8
        pad = t - len(ids)
        bt = np.zeros((s, w), np.int32)
        bt[:3, : meta.block_tables.shape[1]] = meta.block_tables.numpy()
        inputs = (np.concatenate([ids.numpy(), np.zeros(pad)]).astype(np.int32),
                  np.concatenate([pos.numpy(), np.zeros(pad)]).astype(np.int32),
                  np.concatenate([meta.slot_mapping.numpy(), np.full(pad, sink * PAGE)]).astype(np.int32),
                  np.array(meta.query_start_loc_cpu + [meta.query_start_loc_cpu[-1]] * (s - 3), np.int32),
                  np.array(lens + [0] * (s - 3), np.int32), bt)
        hidden, new_kv = fwd([c.array for c in jax_kv], *inputs)
        for c, a in zip(jax_kv, new_kv):
            c.array = a
        got = torch.from_numpy(np.array(hidden)[: len(ids)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for c, r in zip(jax_kv, ref_kv):
        got = _plugin().pagedllm_gather_kv_blocks(c, torch.arange(nb))
        torch.testing.assert_close(got, r[:, :nb], equal_nan=True, atol=1e-4, rtol=1e-4)


def test_jnp_sampler_follows_the_host_filters():
    """Greedy and top_k=1 rows are the argmax; random rows never leave top-k / top-p / min-p and follow the
    renormalised distribution (core's host filters are the oracle)."""
    import jax

    from pagedllm.sample.sampler import top_k_top_p_cutoff
    from pagedllm_tpu.sampler import sample

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 1.0])
    top_k = torch.tensor([0, 5, 0, 3, 1, 0])
    top_p = torch.tensor([1.0, 1.0, 0.6, 0.9, 1.0, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.2])
    scaled = logits / temp.clamp(min=1e-5)[:, None]
    cut = top_k_top_p_cutoff(scaled.clone(), torch.where(top_k > 0, top_k, 50), top_p)
    allowed = scaled >= cut[:, None]
    probs = scaled.softmax(-1)
    allowed[5] = probs[5] >= 0.2 * probs[5].max()
    fn = jax.jit(lambda key: sample(logits.numpy(), temp.numpy(), top_k.numpy().astype(np.int32), top_p.numpy(),
                                    min_p.numpy(), key))
    keys = jax.random.split(jax.random.PRNGKey(0), 400)
    toks = np.stack([np.asarray(fn(k)) for k in keys])  # [400, 6]
    counts = torch.zeros(6, 50)
    for row in range(6):
        counts[row] = torch.bincount(torch.from_numpy(toks[:, row].astype(np.int64)), minlength=50).float()
    assert counts[0, logits[0].argmax()] == 400 and counts[4, logits[4].argmax()] == 400
    assert bool((counts[~allowed] == 0).all())
    want = torch.where(allowed[1], probs[1], 0.0)
    want = want / want.sum()
    assert (counts[1] / 400 - want).abs().max() < 0.08
