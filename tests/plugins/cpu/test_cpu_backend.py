"""The CPU backend plugin: discovery through its entry point, host facts, and its kernels against core's reference ops.

Caches start poisoned with NaN and block 0 (what block-table padding points at) is never handed out, so a kernel that
reads an unwritten slot, a padding block or a key outside the window produces NaN or a mismatch instead of passing.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import random

import pytest
import torch

import pagedllm.backend.registry as backends
from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import KVCacheSpec

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


@pytest.fixture(scope="module")
def cpu() -> backends.Backend:
    return backends.get_backend("cpu")


# ---- discovery, identity, host facts ------------------------------------------------------------------------------
def test_entry_point_is_declared_by_the_distribution():
    eps = [ep for ep in md.entry_points(group="pagedllm.backends") if ep.name == "cpu"]
    assert len(eps) == 1 and eps[0].value == "pagedllm_cpu.plugin" and eps[0].dist.name == "pagedllm-cpu"


def test_discovery_and_selection(cpu):
    found = backends.discover(refresh=True)
    assert "cpu" in found and found["cpu"].backend is not None, found
    assert found["cpu"].distribution == "pagedllm-cpu"
    be = backends.get_backend("cpu")
    assert be.info.name == "cpu" and be.info.device_type == "cpu" and be.info.priority == 10
    assert be.info.extra == "cpu"
    others = [d.backend for n, d in found.items()
              if n != "cpu" and d.backend is not None and d.backend.probe.usable and d.backend.info.priority > 10]
    if not others:  # on a host where no accelerator backend is usable, auto must fall to the CPU
        assert backends.get_backend("auto").name == "cpu"
    for hook in ("pagedllm_write_kv", "pagedllm_paged_attention", "pagedllm_rotary", "pagedllm_graph_runner"):
        assert be.implements(hook), hook
    assert be.distributed_backend() == "gloo"


def test_probe_names_the_cpu(cpu):
    probe = cpu.probe
    assert probe.usable and probe.device_name
    flags = ""
    if os.path.exists("/proc/cpuinfo"):
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    for isa in ("avx512f", "avx2"):
        if f" {isa} " in f"{flags} ":
            assert isa in probe.device_name
            break


def test_memory_info_is_plausible(cpu):
    mem = cpu.memory_info(torch.device("cpu"))
    assert 0 < mem.free_bytes <= mem.total_bytes
    assert mem.total_bytes <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert not mem.pinned_host
    if hasattr(mem, "default_kv_bytes"):
        assert 0 < mem.default_kv_bytes <= mem.free_bytes


def test_capabilities(cpu):
    caps = cpu.capabilities
    assert set(caps.dtypes) == {"float32", "bfloat16", "float16"}
    assert caps.head_sizes is None  # any head size
    assert caps.block_sizes[0] == 16 and {8, 16, 32, 64, 128} <= set(caps.block_sizes)  # 16 is the default
    assert caps.sliding_window and caps.soft_cap and caps.graph_capture in ("none", "decode", "full", "compile")


def test_allocate_kv_cache_is_canonical(cpu):
    spec = KVCacheSpec(num_layers=3, num_blocks=7, block_size=16, num_kv_heads=2, head_size=64,
                       dtype=torch.bfloat16, device=torch.device("cpu"))
    caches = cpu.allocate_kv_cache(spec)
    assert len(caches) == 3
    for c in caches:
        assert c.shape == (2, 7, 16, 2, 64) and c.dtype == torch.bfloat16 and c.is_contiguous()
    assert caches[0].data_ptr() != caches[1].data_ptr()
    # Left uninitialised on purpose (lazy pages): kernels must never read an unwritten slot into an output, which
    # every attention test here checks by poisoning caches with NaN, and the engine test below checks end to end.


def test_engine_on_garbage_filled_kv_pool_matches_reference_backend(cpu, tiny_llama, ref_backend):
    """The pool starts as whatever memory held: fill it with NaN before generating; greedy tokens must equal a run
    whose every op is core's reference."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.backend.registry import register_backend

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    llm = LLM(tiny_llama, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    for c in llm.llm_engine.kv_caches:
        c.fill_(float("nan"))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    register_backend(ref_backend.plugin, "ref-test")
    ref = LLM(tiny_llama, device=ref_backend.name, dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    assert got == [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]


# ---- write_kv ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(cpu, dtype):
    g = torch.Generator().manual_seed(1)
    nb, bs, hkv, d = 6, 8, 2, 32
    slots = torch.randperm(nb * bs, generator=g)[:20]
    slots[[3, 11, 19]] = -1
    key, value = torch.randn(20, hkv, d, generator=g), torch.randn(20, hkv, d, generator=g)  # float32 into dtype
    want = torch.full((2, nb, bs, hkv, d), float("nan"), dtype=dtype)
    got = want.clone()
    ref_ops.write_kv(key, value, want, slots)
    cpu.write_kv(key, value, got, slots, 1.0, 1.0)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())
    assert got.isnan().sum() == 2 * (nb * bs - 17) * hkv * d  # exactly the 17 real slots were written


def test_write_kv_all_padding_and_empty(cpu):
    cache = torch.full((2, 2, 8, 1, 32), float("nan"))
    cpu.write_kv(torch.randn(3, 1, 32), torch.randn(3, 1, 32), cache, torch.tensor([-1, -1, -1]), 1.0, 1.0)
    cpu.write_kv(torch.randn(0, 1, 32), torch.randn(0, 1, 32), cache, torch.zeros(0, dtype=torch.long), 1.0, 1.0)
    assert cache.isnan().all()


# ---- paged attention ---------------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def gather_path(monkeypatch):
    """These tests cover the gather + SDPA decode path (fp8 caches, no compiler, kernel not built yet) whatever the
    C++ decode kernel's state; test_cpu_paged_decode.py runs the same shapes on the kernel."""
    monkeypatch.setenv("PAGEDLLM_CPU_PAGED_DECODE", "0")


def make_batch(query_lens, seq_lens, num_heads, num_kv_heads, head_size, block_size, dtype, seed=0):
    """Random non-contiguous block tables (block 0 reserved as padding), a NaN-poisoned cache holding each
    sequence's context, and random queries."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    need = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(need) + 5
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, block_size)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    slots = [t[p // block_size] * block_size + p % block_size for s, t in zip(seq_lens, tables) for p in range(s)]
    n = len(slots)
    k = torch.randn(n, num_kv_heads, head_size, generator=g)
    v = torch.randn(n, num_kv_heads, head_size, generator=g)
    ref_ops.write_kv(k, v, cache, torch.tensor(slots))
    query = torch.randn(meta.num_tokens, num_heads, head_size, generator=g).to(dtype)
    return query, cache, meta


# 4 decodes (one at a block boundary, one of length 1), then prefill chunks: a fresh prompt, chunks with cached
# context, a one-token chunk after a prefill, and a chunk longer than the window.
MIXED = ([1, 1, 1, 1, 17, 6, 1, 20], [9, 40, 1, 32, 17, 50, 30, 100])


def check(cpu, query, cache, meta, scale, window, cap):
    want = ref_ops.paged_attention(query, cache, meta, scale, window, cap)
    got = cpu.paged_attention(query, cache, meta, scale, window, cap, 1.0, 1.0)
    assert got.dtype == query.dtype and got.shape == query.shape
    assert not got.isnan().any(), "read an unwritten, padding or out-of-window slot"
    atol, rtol = TOL[query.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_size", [32, 64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("window,cap", [(None, None), (13, None), (None, 2.0), (13, 2.0)],
                         ids=["plain", "window", "softcap", "window+softcap"])
def test_paged_attention_matches_reference(cpu, dtype, head_size, block_size, heads, window, cap):
    query, cache, meta = make_batch(*MIXED, *heads, head_size, block_size, dtype,
                                    seed=head_size + block_size + heads[1])
    check(cpu, query, cache, meta, head_size ** -0.5, window, cap)


@pytest.mark.parametrize("head_size,block_size", [(80, 16), (96, 64), (256, 128), (64, 128)])
def test_other_claimed_sizes(cpu, head_size, block_size):
    query, cache, meta = make_batch(*MIXED, 6, 2, head_size, block_size, torch.float32)
    check(cpu, query, cache, meta, head_size ** -0.5, None, None)
    check(cpu, query, cache, meta, head_size ** -0.5, 70, None)


@pytest.mark.parametrize("qlens,slens", [
    ([1] * 6, [5, 16, 17, 33, 64, 2]),  # decodes only
    ([12, 5, 30], [12, 40, 30]),  # prefills only
    ([1, 0, 9], [20, 11, 9]),  # a sequence with no query this step
    ([1] * 7 + [5], [3, 200, 17, 90, 1, 45, 130, 60]),  # skewed decode lengths: batched in length groups
], ids=["decodes", "prefills", "empty-chunk", "skewed-decodes"])
@pytest.mark.parametrize("window", [None, 4])
def test_batch_shapes(cpu, qlens, slens, window):
    query, cache, meta = make_batch(qlens, slens, 8, 4, 32, 16, torch.float32, seed=len(qlens))
    check(cpu, query, cache, meta, 0.2, window, None)


@pytest.mark.parametrize("chunk_bytes", [1, 3 * 2 * 64 * 2 * 32 * 4], ids=["1-seq", "3-seq"])
@pytest.mark.parametrize("window,cap", [(None, None), (21, None), (None, 2.0)])
def test_decodes_in_cache_sized_chunks(cpu, monkeypatch, chunk_bytes, window, cap):
    """Decodes gathered a few sequences at a time (as long contexts are) give the same result."""
    import pagedllm_cpu.attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(cpu_attention, "_SPLIT_MIN_BLOCKS", 0)  # keep short contexts in two length groups
    qlens, slens = [1] * 9 + [6], [3, 64, 17, 50, 1, 45, 60, 33, 64, 40]  # two length groups, 1-3 seqs per chunk
    query, cache, meta = make_batch(qlens, slens, 4, 2, 32, 16, torch.float32, seed=9)
    check(cpu, query, cache, meta, 0.2, window, cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_soft_cap_long_prefill_in_row_chunks(cpu, dtype, monkeypatch):
    """Soft-capped prefill bounds its float32 score matrix by running query rows in passes."""
    import pagedllm_cpu.attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "_SCORES_BUDGET", 8 * 100 * 7)  # 7 query rows per pass
    query, cache, meta = make_batch([1, 1, 40, 33], [10, 70, 40, 100], 8, 2, 64, 16, dtype, seed=5)
    check(cpu, query, cache, meta, 0.125, None, 3.0)
    check(cpu, query, cache, meta, 0.125, 19, 3.0)


def test_per_step_plan_is_reused_across_layers_and_windows(cpu):
    """The plan cached in meta.extra is keyed by window: alternating sliding/global layers (Gemma, Qwen) stay right."""
    query, cache, meta = make_batch(*MIXED, 4, 2, 64, 8, torch.float32)
    other = torch.randn_like(cache).masked_fill_(cache.isnan(), float("nan"))  # a second layer, same step
    for layer_cache, window in [(cache, 7), (other, None), (cache, 7), (other, 7), (cache, None)]:
        check(cpu, query, layer_cache, meta, 0.125, window, None)
    assert any(k.startswith("pagedllm_cpu") for k in meta.extra)


# ---- fused ops and graph runner ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [64, 32])  # full and partial rotary
def test_rotary_is_bitwise_reference(cpu, dtype, rot_dim):
    g = torch.Generator().manual_seed(3)
    cos_sin = torch.randn(128, rot_dim, generator=g)
    pos = torch.randint(0, 128, (19,), generator=g)
    q, k = torch.randn(19, 8, 64, generator=g).to(dtype), torch.randn(19, 2, 64, generator=g).to(dtype)
    want, got = ref_ops.rotary(pos, q, k, cos_sin), cpu.rotary(pos, q, k, cos_sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_graph_runner_is_eager(cpu):
    """Eager was measured faster than torch.compile on CPU (`pagedllm bench graph`): the runner is the model itself."""
    model = torch.nn.Linear(4, 4)
    runner = cpu.graph_runner(model, 8, torch.device("cpu"))
    assert runner.level == "none" == cpu.capabilities.graph_capture
    assert runner.run is model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_and_silu_and_mul_match_reference(dtype):
    from pagedllm.backend import ref_ops
    from pagedllm.backend.registry import get_backend

    b = get_backend("cpu")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(37, 256, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(256, generator=g)).to(dtype)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(b.rms_norm(x, w, 1e-6), ref_ops.rms_norm(x, w, 1e-6), **tol)
    y = torch.randn(37, 512, generator=g).to(dtype)
    tol = dict(atol=0, rtol=0) if dtype == torch.bfloat16 else dict(atol=1e-3, rtol=2e-3) if dtype == torch.float16 \
        else dict(atol=1e-6, rtol=2e-6)  # the C++ op's exp is not torch's (test_cpu_native_ops.py)
    torch.testing.assert_close(b.silu_and_mul(y), ref_ops.silu_and_mul(y), **tol)
