"""The ``xpu`` backend's glue on the simulated Intel GPU (tests/support/sim/xpu): core's conformance kernel/runtime
checks through the plugin's hooks (core's Triton kernels under TRITON_INTERPRET=1, tensors on the host), XPU graph
capture/replay through the recording XPUGraph, and the torch.xpu runtime calls. One subprocess per scenario, so the
patched torch.xpu never leaks into this process. Not a hardware result: docs/backends/xpu.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support" / "sim" / "xpu"))

from sim_xpu.run import run_scenario  # noqa: E402

#: Few enough for < ~60 s under the Triton interpreter; fp32 and fp16 (bf16 is not exact in the interpreter).
CONFORMANCE_CASES = (
    "memory_info", "allocate_kv_cache", "write_kv[hs64-bs16|*", "write_kv[hs80-bs32|*", "gather_kv_blocks[*bs16|*",
    "gather_kv_blocks[*bs32|*", "swap_kv_blocks[*bs16|*", "paged_attention.*[hs64-bs16-*",
    "paged_attention.mixed[hs80-bs32-*", "paged_attention.sliding_window[*bs16*", "paged_attention.soft_cap[*bs16*",
    "rms_norm", "silu_and_mul", "rotary[hs64-*", "graph_runner.replay_vs_eager",
)


def test_xpu_conformance_kernels_and_runtime_on_simulated_device():
    out = run_scenario("conformance", *CONFORMANCE_CASES)
    assert not out["failing"], "\n".join(out["failing"])
    passing = out["passing"]
    assert out["counts"]["passing"] >= 35, out["counts"]
    for kernel in ("memory_info", "write_kv", "paged_attention.decode", "paged_attention.prefill",
                   "paged_attention.mixed", "paged_attention.sliding_window", "paged_attention.soft_cap",
                   "swap_kv_blocks", "rotary", "graph_runner.replay_vs_eager"):
        assert any(p.startswith(kernel + "[") for p in passing), (kernel, passing)
    assert {p.split("|")[1] for p in passing if p.startswith("paged_attention")} == {"float32]", "float16]"}
    # the graph case captured every bucket through the recording XPUGraph and replayed the decodes from it
    assert "'captured': [4, 2, 1]" in out["graph_detail"] and "'replays': 4" in out["graph_detail"], out


def test_xpu_graph_replay_reissues_recorded_work_without_python():
    out = run_scenario("graph")
    assert out["level"] == "decode" and out["stats"]["captured"] == [2, 1], out
    assert out["results"] == [True, True, True], out  # replays see each step's new inputs
    # host code ran 2 warm-ups + 1 capture per bucket, never on replay
    assert out["python_calls"] == [2, 2, 2, 1, 1, 1], out
    assert out["stats"]["replays"] == 3 and out["graph_replays"] == [1, 2], out
    assert out["graph_launches"] == [1, 1], out  # the Triton silu_and_mul launch was recorded in each graph
    assert "aten.item" in out["sync_error"], out  # a host sync inside capture fails as on a device


def test_xpu_runtime_hooks_call_torch_xpu():
    out = run_scenario("probe_sim")  # TRITON_INTERPRET=1: the installed Triton has no Intel backend
    usable, reason, name = out["probe"]
    assert usable and not reason and name.endswith("(simulated) x1"), out
    assert out["dtypes"] == ["float32", "float16", "bfloat16"] and out["dtypes_no_bf16"] == ["float32", "float16"]
    assert out["graph_capture"] == "decode" and out["dist"] == "xccl"
    assert out["memory"] == [64 << 30, 60 << 30, True]
    assert out["peak"] == 3 << 30 and out["peak_after_reset"] == 1 << 20  # read, then reset for the next profile
    assert out["calls"] == [["mem_get_info", "xpu:0"], ["max_memory_allocated", "xpu:0"],
                            ["reset_peak_memory_stats", "xpu:0"], ["set_device", "xpu:0"],
                            ["synchronize", "xpu:0"]], out
    assert out["graphs_off"] == ["none", "none"], out  # PAGEDLLM_XPU_GRAPHS=0: eager, and declared so
    cfg = out["update_config"]  # the config hook: Arc A770's bf16 issue (vllm/platforms/xpu.py)
    assert cfg["max1550_auto"] is None and cfg["a770_fp32"] is None, cfg
    assert cfg["a770_auto"] == {"dtype": "float16"}, cfg
    assert cfg["a770_bf16"].startswith("ParamError(dtype)") and "float16" in cfg["a770_bf16"], cfg


@pytest.mark.slow
def test_xpu_engine_greedy_parity_with_hf_on_simulated_device():
    """The whole engine on the xpu backend: Worker (set_device, profiling run through the peak-memory hooks, KV
    sizing from mem_get_info), XPU graphs captured from the Worker's RunnerContext and replayed for decodes, greedy
    tokens equal to HF transformers. A prompt crosses a block boundary (20 tokens, block size 16)."""
    out = run_scenario("e2e", env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert out["got"] == out["want"], out
    assert out["graph_level"] == "decode" and out["block_size"] == 16, out
    assert out["graphs"] == 2 and out["graph_replays"] > 0, out  # buckets 1 and 2, replayed for decodes
    assert {"set_device", "mem_get_info", "max_memory_allocated", "reset_peak_memory_stats"} <= set(out["calls"])
