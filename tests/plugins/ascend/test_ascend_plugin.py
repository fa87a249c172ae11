"""The ascend plugin on this machine (no torch-npu, no CANN, no NPU): discovery, why it is unusable, that loading it
imports nothing vendor, and the config hook (block size 128, half-precision dtype, refusals) through core's
``resolve_config``. Everything that needs the ``npu`` device runs on the simulated torch-npu: test_ascend_sim.py."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import pagedllm.backend.registry as backends
from pagedllm.config import EngineConfig, resolve_config
from pagedllm.backend.hookspec import API_VERSION, KVCacheSpec, ModelInfo
from pagedllm.errors import ParamError

SIM = str(Path(__file__).resolve().parents[2] / "support" / "sim")
LLAMA = ModelInfo(architecture="LlamaForCausalLM", dtype="float32", num_layers=2, num_heads=4, num_kv_heads=2,
                  head_size=64, vocab_size=512, max_model_len=512)


@pytest.fixture(scope="module")
def ascend() -> backends.Backend:
    item = backends.discover(refresh=True)["ascend"]
    assert item.backend is not None, item.error
    return item.backend


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120)


def test_entry_point_and_identity(ascend):
    eps = [ep for ep in md.entry_points(group="pagedllm.backends") if ep.name == "ascend"]
    assert len(eps) == 1 and eps[0].value == "pagedllm_ascend.plugin" and eps[0].dist.name == "pagedllm-ascend"
    assert eps[0].dist.version == "0.2.0"
    assert any(r.startswith("pagedllm") and ">=0.2" in r and "<0.3" in r for r in eps[0].dist.requires or [])
    info = ascend.info
    assert (info.name, info.device_type, info.api_version, info.extra) == ("ascend", "npu", API_VERSION, "ascend")
    assert ascend.distributed_backend() == "hccl"


def test_probe_says_torch_npu_is_missing_here(ascend):
    import importlib.util

    assert importlib.util.find_spec("torch_npu") is None  # this machine: the reason below is the real one
    p = ascend.probe
    assert not p.usable
    assert "torch-npu not installed" in p.reason and "pip install torch-npu==" in p.reason and "CANN" in p.reason


def test_loading_the_plugin_and_probing_import_nothing_vendor():
    """`pagedllm backends` must stay safe: no torch_npu import at load, none in the probe without CANN (even where a
    torch_npu module is importable: here the simulated one is put on the path)."""
    code = ("import sys, pagedllm.backend.registry as b; be = b.discover()['ascend'].backend; p = be.probe; "
            "print(p.usable, '|', p.reason); print('torch_npu' in sys.modules)")
    res = _run(code, PYTHONPATH=SIM + os.pathsep + os.environ.get("PYTHONPATH", ""))
    assert res.returncode == 0, res.stderr
    first, second = res.stdout.strip().splitlines()[-2:]
    assert first.startswith("False") and "no CANN runtime was found" in first and "ASCEND_HOME_PATH" in first
    assert second == "False"


def test_import_torch_still_works_with_the_plugin_installed():
    res = _run("import torch, pagedllm_ascend.plugin, sys; print(torch.__version__, 'torch_npu' in sys.modules)")
    assert res.returncode == 0 and res.stdout.split()[-1] == "False", res.stderr


def test_version_mismatch_is_read_from_metadata_without_import(monkeypatch):
    from pagedllm_ascend import platform

    monkeypatch.setattr(platform.md, "version", lambda name: "2.5.1.post3")
    reason = platform.version_mismatch()
    assert "torch-npu 2.5.1.post3 needs torch 2.5" in reason and torch.__version__ in reason
    monkeypatch.setattr(platform.md, "version", lambda name: platform._torch_minor() + ".0")
    assert platform.version_mismatch() == ""


def test_cann_home_from_environment(monkeypatch, tmp_path):
    from pagedllm_ascend import platform

    monkeypatch.delenv("ASCEND_HOME_PATH", raising=False)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path))
    assert platform.cann_home() == str(tmp_path)
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(tmp_path / "missing"))
    assert platform.cann_home() in (None, platform.CANN_DEFAULT_DIR)
    assert platform.cann_home() != str(tmp_path / "missing")


def test_capabilities_are_what_the_kernels_take(ascend, monkeypatch):
    caps = ascend.capabilities
    assert caps.block_sizes == (128,) and set(caps.dtypes) == {"bfloat16", "float16"}
    assert caps.soft_cap is False and caps.head_sizes == (64, 128) and caps.sliding_window
    from pagedllm_ascend import plugin

    monkeypatch.delenv("PAGEDLLM_ASCEND_ACL_GRAPH", raising=False)
    assert plugin.pagedllm_capabilities().graph_capture == "none"  # ACL graphs are opt-in
    monkeypatch.setenv("PAGEDLLM_ASCEND_ACL_GRAPH", "1")
    monkeypatch.delenv("PAGEDLLM_DISABLE_GRAPHS", raising=False)
    assert plugin.pagedllm_capabilities().graph_capture == "decode"
    monkeypatch.setenv("PAGEDLLM_DISABLE_GRAPHS", "1")
    assert plugin.pagedllm_capabilities().graph_capture == "none"


# ---- the config hook, through core's resolve_config ----------------------------------------------------------------
def test_resolve_config_gives_block_size_128_and_a_half_precision_dtype(ascend):
    cfg = resolve_config(EngineConfig(), ascend, LLAMA)
    assert cfg.block_size == 128 and cfg.dtype == "bfloat16"  # float32 checkpoint: bf16
    cfg = resolve_config(EngineConfig(), ascend, replace(LLAMA, dtype="float16"))
    assert cfg.dtype == "float16"  # the checkpoint's half dtype is kept
    cfg = resolve_config(EngineConfig(block_size=128, dtype="float16"), ascend, LLAMA)
    assert (cfg.block_size, cfg.dtype) == (128, "float16")


@pytest.mark.parametrize("kwargs, field, words", [
    (dict(block_size=16), "block_size", "128-token blocks"),
    (dict(dtype="float32"), "dtype", "float16 or bfloat16"),
])
def test_config_hook_refuses_with_a_reason(ascend, kwargs, field, words):
    with pytest.raises(ParamError) as e:
        resolve_config(EngineConfig(**kwargs), ascend, LLAMA)
    assert e.value.field == field and words in str(e.value)


def test_core_refuses_soft_cap_and_other_head_sizes_before_loading(ascend):
    with pytest.raises(ParamError, match="soft-capping"):
        resolve_config(EngineConfig(), ascend, replace(LLAMA, soft_cap=30.0))
    with pytest.raises(ParamError, match="head size 80"):
        resolve_config(EngineConfig(), ascend, replace(LLAMA, head_size=80))


def test_host_cache_layout_without_a_device(ascend):
    """Host swap caches: one (K, V) pair per layer, [num_blocks, block_size, Hkv, D] each, on the CPU (pinning
    needs the device runtime: checked on the simulated device)."""
    spec = KVCacheSpec(3, 4, 128, 2, 64, torch.float16, torch.device("cpu"))
    caches = ascend.allocate_host_kv_cache(spec, False)
    assert len(caches) == 3
    for pair in caches:
        assert isinstance(pair, tuple) and len(pair) == 2
        assert all(t.shape == (4, 128, 2, 64) and t.dtype == torch.float16 and t.device.type == "cpu" for t in pair)
    assert sum(t.numel() * t.element_size() for p in caches for t in p) == 4 * spec.bytes_per_block


def test_acl_graphs_stay_off_for_sliding_window_models(monkeypatch):
    """Only _npu_paged_attention's host lengths are updated per replay; a sliding-window decode runs FIA, so such a
    model runs eagerly even when ACL graphs are opted in (decided before torch.npu is touched)."""
    from types import SimpleNamespace

    from pagedllm_ascend import graph

    monkeypatch.setenv("PAGEDLLM_ASCEND_ACL_GRAPH", "1")
    monkeypatch.delenv("PAGEDLLM_DISABLE_GRAPHS", raising=False)
    model = object()
    ctx = SimpleNamespace(model_info=replace(LLAMA, sliding_window=4096), max_model_len=512)
    runner = graph.make_runner(model, 4, torch.device("cpu"), ctx)
    assert runner.run is model and runner.level == "none" and "sliding-window" in runner.stats["reason"]
    monkeypatch.delenv("PAGEDLLM_ASCEND_ACL_GRAPH")
    runner = graph.make_runner(model, 4, torch.device("cpu"), ctx)
    assert runner.run is model and runner.level == "none" and runner.stats["opt_in"] == "PAGEDLLM_ASCEND_ACL_GRAPH=1"


def test_pagedllm_backends_lists_ascend_with_its_reason():
    res = _run("import sys; from pagedllm.cli import main; sys.exit(main(['backends']))")
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("ascend ")), "")
    assert res.returncode == 0 and "pagedllm-ascend" in line and "torch-npu not installed" in line, res.stdout
