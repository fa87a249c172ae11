"""The portable Triton kernels (core/pagedllm/kernels), run on CPU tensors by Triton's interpreter.

The op hooks are exactly the ones the cuda and rocm plugins re-export; here they sit in a test backend whose device
is the CPU. Grids are kept tiny (the interpreter costs milliseconds per program instance). The compiled GPU code
path, which the interpreter never sees, is checked by compiling every kernel for sm_80, sm_90 and gfx942.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import subprocess  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedllm.backend import ref_ops  # noqa: E402
from pagedllm.backend.attention import AttentionMetadata  # noqa: E402
from pagedllm.backend.registry import Backend  # noqa: E402
from pagedllm.conformance import run_conformance  # noqa: E402
from pagedllm.backend.hookspec import Capabilities, GraphRunner  # noqa: E402
from pagedllm.backend.triton import hooks as ops_plugin  # noqa: E402
from pagedllm.backend.graph_runner import DecodeGraphRunner, default_buckets  # noqa: E402
from plugin_factory import make_plugin  # noqa: E402

CAPS = Capabilities(dtypes=("float32", "float16", "bfloat16"), head_sizes=(32, 80), block_sizes=(16,),
                    graph_capture="decode", alibi=True, sliding_window=True, soft_cap=True, mla=True)


class ReplayingRunner(DecodeGraphRunner):
    """The cuda/rocm graph runner with the capture step replaced by re-running the captured closure: everything
    else (buckets, padding, persistent metadata buffers, host-list guard) is the real code. CUDA/HIP capture itself
    only runs on a GPU (ci/gpu_check.sh)."""

    def _capture(self, fn):
        fn()  # the warm-up/capture call happens here too: a kernel reading host lists fails now
        return fn


def triton_cpu_plugin(caps: Capabilities = CAPS) -> SimpleNamespace:
    def graph_runner(model, max_num_seqs, device):
        runner = ReplayingRunner(model, max_num_seqs, device)
        return GraphRunner(run=runner, level="decode", stats=runner.stats)

    ops = {name.removeprefix("pagedllm_"): getattr(ops_plugin, name) for name in ops_plugin.__all__}
    return make_plugin("triton-cpu", caps, device_name="CPU via TRITON_INTERPRET=1", graph_runner=graph_runner, **ops)


@pytest.fixture(scope="module")
def triton_backend() -> Backend:
    return Backend(triton_cpu_plugin(), "triton-cpu")


def test_triton_kernels_pass_conformance(triton_backend, tmp_path):
    """Every kernel check over fp32/fp16/bf16 x head sizes 32, 80 x GQA 1/3/4 (decode = split-K path, prefill and
    mixed = one-pass path), the graph runner's bucketing with these kernels, and greedy parity with HF through the
    engine."""
    assert triton_backend.implements("pagedllm_paged_attention")
    report = run_conformance(triton_backend, report_dir=str(tmp_path))
    failing = [f"{r.id}: {r.error}" for r in report.failing]
    assert not failing, "\n".join(failing)
    counts = report.counts()
    assert counts["untested"] == 0 and counts["passing"] > 50, counts
    attention = [r for r in report.results if r.kernel.startswith("paged_attention")]
    assert {r.dtype for r in attention} == {"float32", "float16", "bfloat16"}
    graph = next(r for r in report.results if r.feature == "graph")
    assert "'replays': 4" in graph.detail and "'captured': [4, 2, 1]" in graph.detail, graph.detail
    assert (tmp_path / "conformance-triton-cpu.md").exists()


def _batch(qlens, slens, bs, hkv, hs, dtype, gen):
    needed = [-(-s // bs) for s in slens]
    perm = torch.randperm(sum(needed) + 2, generator=gen).tolist()
    tables, k = [], 0
    for n in needed:
        tables.append(perm[k:k + n])
        k += n
    cache = torch.full((2, len(perm), bs, hkv, hs), float("nan"), dtype=dtype)
    slots = torch.tensor([t[p // bs] * bs + p % bs for t, s in zip(tables, slens) for p in range(s)])
    ref_ops.write_kv(torch.randn(len(slots), hkv, hs, generator=gen).to(dtype),
                     torch.randn(len(slots), hkv, hs, generator=gen).to(dtype), cache, slots)
    return cache, AttentionMetadata.build(qlens, slens, tables, bs)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_split_k_on_mixed_batch_with_window_and_cap(dtype, atol):
    """The split-K path (forced) on prefill chunks too, odd head size 80 (padded tiles), block size 8, GQA 3."""
    from pagedllm.backend.triton.attention import paged_attention

    gen = torch.Generator().manual_seed(1)
    cache, meta = _batch([1, 7, 12], [40, 19, 12], 8, 1, 80, dtype, gen)
    q = torch.randn(meta.num_tokens, 3, 80, generator=gen).to(dtype)
    for window, cap in ((None, None), (9, 2.0)):
        ref = ref_ops.paged_attention(q, cache, meta, 80 ** -0.5, window, cap)
        for segments in (1, 4):
            out = paged_attention(q, cache, meta, 80 ** -0.5, window, cap, num_segments=segments)
            torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)


def test_graph_runner_refuses_host_lists_inside_capture():
    def reads_host_lengths(ids, pos, meta):
        return torch.zeros(len(ids), 4) + sum(meta.seq_lens_cpu)

    runner = ReplayingRunner(reads_host_lengths, 2, torch.device("cpu"))
    meta = AttentionMetadata.build([1], [5], [[0]], 16)
    with pytest.raises(RuntimeError, match="not available inside a captured graph"):
        runner(torch.tensor([3]), torch.tensor([4]), meta)
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40] and default_buckets(1) == [1]


def test_prefill_bypasses_graphs_and_wide_tables_fall_back():
    calls = []

    def model(ids, pos, meta):
        calls.append(meta.max_query_len)
        return ids.float()[:, None] * 2

    runner = ReplayingRunner(model, 4, torch.device("cpu"))
    pre = AttentionMetadata.build([3], [3], [[0]], 16)
    out = runner(torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]), pre)
    assert out.flatten().tolist() == [2, 4, 6] and runner.stats["eager"] == 1 and not runner.replays
    dec = AttentionMetadata.build([1, 1, 1], [4, 4, 4], [[0], [1], [2]], 16)
    out = runner(torch.tensor([5, 6, 7]), torch.tensor([3, 3, 3]), dec)
    assert out.flatten().tolist() == [10, 12, 14] and runner.stats["replays"] == 1
    wide = AttentionMetadata.build([1], [4], [[0] * (runner.width + 1)], 16)
    runner(torch.tensor([5]), torch.tensor([3]), wide)
    assert runner.stats["eager"] == 2


def test_kernels_compile_for_gpu_targets(tmp_path):
    """The real GPU code path (which the interpreter never compiles) through Triton's compiler to cubin for
    sm_80/sm_90 and hsaco for gfx942: no GPU needed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    cmd = [sys.executable, "-m", "pagedllm.backend.triton.aot_check", "--target", "cuda:80", "--target", "cuda:90",
           "--target", "hip:gfx942"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "45/45 compiled" in res.stdout, res.stdout


def test_loading_gpu_plugins_imports_no_triton():
    code = ("import sys, pagedllm_cuda.plugin, pagedllm_rocm.plugin, pagedllm.backend.accelerator; "
            "assert 'triton' not in sys.modules, 'triton imported'")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
