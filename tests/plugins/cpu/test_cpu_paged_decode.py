"""The CPU plugin's C++ paged decode kernel (``pagedllm_cpu/csrc/paged_decode.cpp``) against core's reference
attention, over odd shapes: head sizes 48/80, GQA 5:1, sliding windows, soft cap, ALiBi, partly filled blocks.

Caches are NaN-poisoned outside the written slots and block 0 is never handed out (``make_batch``), so reading an
unwritten slot, a padding block or a key outside the window shows up as NaN. The kernel must build here (g++ is on
the CI image): a failed build fails these tests rather than skipping them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import pagedllm.backend.registry as backends
from pagedllm.backend import ref_ops
from pagedllm_cpu import attention as cpu_attention
from pagedllm_cpu import native
from test_cpu_backend import MIXED, TOL, make_batch

BUILD_TIMEOUT_S = 600  # a cold build takes 10 s on an idle 2-core machine, minutes when it is busy


@pytest.fixture(scope="module")
def op():
    got = native.get(wait=True, timeout=BUILD_TIMEOUT_S)
    assert got is not None, f"the kernel did not build: {native.error()}"
    return got


@pytest.fixture(scope="module")
def cpu() -> backends.Backend:
    return backends.get_backend("cpu")


def alibi(num_heads: int) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)])


def run_op(op, query, cache, meta, scale, window, cap, slopes):
    nd = meta.num_decodes
    out = torch.full_like(query[:nd], float("nan"))
    op(out, query[:nd], cache, meta.block_tables, meta.seq_lens, scale, window or 0, cap or 0.0, slopes)
    return out


# Decodes only: lengths 1, a block boundary (16, 32), partly filled last blocks, one long context. Where a work item
# reads a 4 KiB page or more of each token row, the kernel takes its tiled two-walk path: mha32-d64 in fp32 (8 KiB
# rows; 4 KiB halves where these 7 sequences split the kv heads over 2 threads), and at one thread mha32-d64 in bf16
# and mha6-d176 in fp32 (4,224 bytes, a head size with a vector tail); the other shapes take the per-head walk.
# ``test_tiled_walk_on_whole_rows_matches_reference`` takes those shapes down the tiled walk at any thread count.
DECODES = ([1] * 7, [1, 16, 17, 33, 5, 32, 151])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads,head_size", [((10, 2), 48), ((4, 4), 80), ((9, 3), 64), ((8, 1), 128),
                                             ((32, 32), 64), ((6, 6), 176)],
                         ids=["gqa5-d48", "mha-d80", "gqa3-d64", "mqa-d128", "mha32-d64", "mha6-d176"])
@pytest.mark.parametrize("window,cap,use_alibi", [(None, None, False), (13, None, False), (None, 30.0, False),
                                                  (None, None, True), (7, 2.0, True)],
                         ids=["plain", "window", "softcap", "alibi", "all"])
@pytest.mark.parametrize("block_size", [16, 8])
def test_kernel_matches_reference(op, dtype, heads, head_size, window, cap, use_alibi, block_size):
    query, cache, meta = make_batch(*DECODES, *heads, head_size, block_size, dtype, seed=head_size + block_size)
    check_reference(op, query, cache, meta, heads, head_size, dtype, window, cap, use_alibi)


@pytest.mark.parametrize("dtype,heads,head_size", [(torch.bfloat16, (32, 32), 64), (torch.float16, (32, 32), 64),
                                                   (torch.float32, (6, 6), 176)],
                         ids=["mha32-d64-bf16", "mha32-d64-fp16", "mha6-d176-fp32"])
@pytest.mark.parametrize("window,cap,use_alibi", [(None, None, False), (7, 2.0, True)], ids=["plain", "all"])
def test_tiled_walk_on_whole_rows_matches_reference(op, dtype, heads, head_size, window, cap, use_alibi):
    """Rows of a page or more, read whole (4 x threads sequences: one item each, no head split), take the tiled
    two-walk path at any thread count; the small batch above reaches it for these shapes only at one thread."""
    n = 4 * torch.get_num_threads()
    seq_lens = [1 + (37 * i) % 70 for i in range(n - 1)] + [151]
    query, cache, meta = make_batch([1] * n, seq_lens, *heads, head_size, 16, dtype, seed=n)
    check_reference(op, query, cache, meta, heads, head_size, dtype, window, cap, use_alibi)


def check_reference(op, query, cache, meta, heads, head_size, dtype, window, cap, use_alibi):
    """The kernel's output against core's reference op, within the dtype's tolerance, no unwritten slot read."""
    slopes = alibi(heads[0]) if use_alibi else None
    scale = head_size ** -0.5
    want = ref_ops.paged_attention(query, cache, meta, scale, window, cap, alibi_slopes=slopes)
    got = run_op(op, query, cache, meta, scale, window, cap, slopes)
    assert not got.isnan().any(), "read an unwritten, padding or out-of-window slot"
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("num", [1, 3, 40])
@pytest.mark.parametrize("heads", [(12, 1), (20, 2), (32, 32)], ids=["mqa12", "gqa10", "mha32"])
def test_kernel_splits_work_and_head_groups(op, threads, num, heads):
    """GQA groups wider than the kernel's 8-head register chunk (8 + 4, 8 + 2), and both ways of splitting work:
    one item per sequence (batch >= 4 x threads) or a sequence's kv heads over several items (small batches). MHA
    with 8 KiB token rows: the tiled walk for whole rows (40 sequences), the per-head walk for split heads."""
    seq_lens = [1 + (37 * i) % 70 for i in range(num)]
    query, cache, meta = make_batch([1] * num, seq_lens, *heads, 64, 16, torch.float32, seed=num)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = run_op(op, query, cache, meta, 0.125, None, None, None)
    finally:
        torch.set_num_threads(saved)
    assert not got.isnan().any()
    torch.testing.assert_close(got, ref_ops.paged_attention(query, cache, meta, 0.125), atol=1e-5, rtol=1e-5)


def test_kernel_reads_strided_query_and_output(op):
    """Query rows straight out of a fused qkv projection (row stride > H * D) and a strided output."""
    query, cache, meta = make_batch(*DECODES, 10, 2, 48, 16, torch.float32, seed=3)
    qkv = torch.randn(query.shape[0], 14, 48)
    qkv[:, :10] = query
    out = torch.empty(query.shape[0], 12, 48)[:, 1:11]
    op(out, qkv[:, :10], cache, meta.block_tables, meta.seq_lens, 0.15, 0, 0.0, None)
    torch.testing.assert_close(out, ref_ops.paged_attention(query, cache, meta, 0.15), atol=1e-5, rtol=1e-5)


def test_kernel_refuses_bad_arguments(op):
    query, cache, meta = make_batch(*DECODES, 4, 2, 32, 16, torch.float32)
    out = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(out, query, cache.bfloat16(), meta.block_tables, meta.seq_lens, 1.0, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="block_tables must be int32"):
        op(out, query, cache, meta.block_tables.long(), meta.seq_lens, 1.0, 0, 0.0, None)
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        op(out, query, cache, meta.block_tables, meta.seq_lens, 1.0, 0, 0.0, torch.ones(3))
    with pytest.raises(RuntimeError, match="head size"):
        op(out[..., :16], query[..., :16], cache, meta.block_tables, meta.seq_lens, 1.0, 0, 0.0, None)


@pytest.mark.parametrize("window,cap,use_alibi", [(None, None, False), (13, 2.0, False), (None, None, True)])
def test_backend_hook_uses_the_kernel_for_decodes(op, cpu, window, cap, use_alibi):
    """Through the backend hook on a mixed step: decodes on the kernel (no decode gather planned), prefill chunks on
    SDPA, one result equal to the reference."""
    query, cache, meta = make_batch(*MIXED, 10, 2, 48, 16, torch.float32, seed=5)
    slopes = alibi(10) if use_alibi else None
    want = ref_ops.paged_attention(query, cache, meta, 0.2, window, cap, alibi_slopes=slopes)
    got = cpu.paged_attention(query, cache, meta, 0.2, window, cap, 1.0, 1.0, slopes)
    plans = meta.extra[cpu_attention._PLAN_KEY]
    assert list(plans) == [(window, False)] and plans[(window, False)].decodes == []
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_fp8_cache_keeps_the_gather_path(op, cpu):
    """fp8 caches are not the kernel's: decodes gather and convert as before, still equal to the reference."""
    query, cache, meta = make_batch(*DECODES, 9, 3, 64, 16, torch.float32, seed=7)
    fp8 = torch.full(cache.shape, float("nan")).to(torch.float8_e4m3fn)
    slots = torch.tensor([t * 16 + p % 16 for s, row in zip(meta.seq_lens_cpu, meta.block_tables.tolist())
                          for p in range(s) for t in [row[p // 16]]])
    flat = cache.view(2, -1, 3, 64)
    cpu.write_kv(flat[0, slots], flat[1, slots], fp8, slots, 0.5, 0.25)
    want = ref_ops.paged_attention(query, fp8, meta, 0.125, k_scale=0.5, v_scale=0.25)
    got = cpu.paged_attention(query, fp8, meta, 0.125, None, None, 0.5, 0.25)
    assert (None, True) in meta.extra[cpu_attention._PLAN_KEY]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


_PROBE = textwrap.dedent("""
    import logging, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(levelname)s %(message)s")
    import torch
    from pagedllm.backend import ref_ops
    from pagedllm.backend.attention import AttentionMetadata
    from pagedllm_cpu import attention, native
    op = native.get(wait=True)
    meta = AttentionMetadata.build([1, 1], [3, 20], [[1], [2, 3]], 16)
    cache = torch.randn(2, 4, 16, 2, 32)
    q = torch.randn(2, 4, 32)
    for _ in range(2):  # a second call must not log again
        got = attention.paged_attention(q, cache, meta, 0.3)
    torch.testing.assert_close(got, ref_ops.paged_attention(q, cache, meta, 0.3))
    print("KERNEL", op is not None, native.error())
""")


def _probe(cache_dir, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S,
                          env={**os.environ, "PAGEDLLM_CACHE": str(cache_dir), **env})


def test_no_compiler_keeps_the_sdpa_path_and_says_so_once(op, tmp_path):
    """No compiler and nothing cached: attention still works (SDPA path) and one warning names the reason."""
    r = _probe(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert r.returncode == 0, r.stderr
    assert "KERNEL False" in r.stdout, r.stdout
    warnings = [ln for ln in r.stdout.splitlines() if "C++ kernels unavailable" in ln]
    assert len(warnings) == 1 and "gather + SDPA" in warnings[0], r.stdout


def test_a_built_kernel_is_loaded_from_the_cache(op):
    """The build is cached per (source, torch, Python, capability): a new process loads it without compiling."""
    path = native.library_path()
    assert path.is_file() and torch.backends.cpu.get_cpu_capability().lower() in path.name
    r = _probe(path.parents[1], CXX="/no-such-compiler")
    assert r.returncode == 0 and "KERNEL True None" in r.stdout, r.stdout + r.stderr


def test_disabled_by_environment(op, cpu, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_PAGED_DECODE", "0")
    assert native.get() is None
    query, cache, meta = make_batch(*DECODES, 4, 2, 32, 16, torch.float32, seed=11)
    got = cpu.paged_attention(query, cache, meta, 0.2, None, None, 1.0, 1.0)
    assert (None, True) in meta.extra[cpu_attention._PLAN_KEY]
    torch.testing.assert_close(got, ref_ops.paged_attention(query, cache, meta, 0.2), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen2_swa", "gemma2"])
def test_engine_greedy_parity_on_the_kernel(op, tiny_model_dirs, tmp_path, monkeypatch, name):
    """End to end: the engine (decodes on the kernel) stays token-identical to HF greedy; qwen2_swa has a sliding
    window of 8, the gemma2 fallback soft cap, alternating windows, head size 48 and GQA 5:1."""
    import hf_oracle
    import tiny_models
    from transformers import AutoModelForCausalLM

    from pagedllm import LLM, SamplingParams

    calls = []
    monkeypatch.setattr(native, "_op", lambda *args: (calls.append(1), op(*args)))
    path = tiny_model_dirs[name] if name in tiny_model_dirs else tiny_models.make_fallback_model(name, tmp_path / name)
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (3, 17, 30, 9, 41)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert [o.outputs[0].token_ids for o in outs] == [hf_oracle.hf_greedy(hf, p, 12) for p in prompts]
    assert len(calls) >= 11 * hf.config.num_hidden_layers  # every decode step, layer
