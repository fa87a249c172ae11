"""The ``ipex`` backend (Intel CPUs through intel-extension-for-pytorch) against a fake IPEX that implements
``ipex.llm.modules.PagedAttention`` with core's reference ops (tests/support/sim/xpu): the version guard refuses a
mismatched IPEX without importing it, survives an IPEX that exits on import, and the backend's KV layout and op
glue pass core's conformance suite including greedy parity with HF through the engine. Not a hardware result."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support" / "sim" / "xpu"))

from sim_xpu.fake_ipex import make_site  # noqa: E402
from sim_xpu.run import run_scenario  # noqa: E402

MATCHING = ".".join(torch.__version__.split(".")[:2]) + ".0+cpu"  # a build for this torch's major.minor

CASES = ("memory_info", "allocate_kv_cache", "write_kv", "gather_kv_blocks", "swap_kv_blocks",
         "paged_attention.*[hs16-*", "paged_attention.*[hs80-bs16-*", "paged_attention.*[hs64-bs128-*",
         "paged_attention.sliding_window", "paged_attention.soft_cap", "graph_runner.replay_vs_eager",
         "greedy_parity_vs_hf")


def test_guard_refuses_mismatched_ipex_without_importing_it(tmp_path):
    site = make_site(tmp_path / "site", "2.8.0+cpu", trap=True)  # importing it would exit the process
    marker = tmp_path / "imported"
    out = run_scenario("ipex_probe", str(marker), extra_path=[site], interpret=False,
                       env={"FAKE_IPEX_IMPORTED_MARKER": str(marker)})
    assert not out["usable"] and "built for torch 2.8.x" in out["reason"], out
    assert not out["imported"] and not out["marker"], out


def test_guard_survives_an_ipex_that_exits_on_import(tmp_path):
    site = make_site(tmp_path / "site", MATCHING, trap=True)
    marker = tmp_path / "imported"
    out = run_scenario("ipex_probe", str(marker), extra_path=[site], interpret=False,
                       env={"FAKE_IPEX_IMPORTED_MARKER": str(marker)})
    assert out["marker"], out  # versions matched, so it was imported ...
    assert not out["usable"] and "failed: SystemExit" in out["reason"], out  # ... and the exit became a reason


def test_ipex_backend_passes_conformance_on_fake_ipex(tmp_path):
    site = make_site(tmp_path / "site", MATCHING)
    probe = run_scenario("ipex_probe", extra_path=[site], interpret=False)
    assert probe["usable"] and probe["device_name"].endswith(MATCHING), probe
    out = run_scenario("ipex_conformance", *CASES, extra_path=[site], interpret=False)
    assert not out["failing"], "\n".join(out["failing"])
    assert out["ipex_calls"] == ["flash_attn_varlen_func", "reshape_and_cache", "single_query_cached_kv_attention"]
    passing = out["passing"]
    assert any(p.startswith("greedy_parity_vs_hf[") for p in passing), passing
    for kernel in ("write_kv", "gather_kv_blocks", "swap_kv_blocks", "paged_attention.decode",
                   "paged_attention.prefill", "paged_attention.mixed"):
        assert {p.split("|")[1] for p in passing if p.startswith(kernel + "[")} == {"float32]", "bfloat16]"}, kernel
    # undeclared features are reported untested with the reason, never as passing
    assert out["untested"] and all("capabilities do not declare" in why for key, why in out["untested"].items()
                                   if key.startswith(("paged_attention.sliding_window", "paged_attention.soft_cap")))
