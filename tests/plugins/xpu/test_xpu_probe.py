"""pagedllm-xpu on this machine (no Intel GPU, CPU-only torch, no IPEX): both backends load, say why they are not
usable, import neither Triton nor IPEX, and leave ``import torch`` working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from pagedllm.backend.registry import discover
from pagedllm_xpu import platform as xpu_platform, vendor as ipex_vendor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "support" / "sim" / "xpu"))

from sim_xpu.run import run_scenario  # noqa: E402


def test_xpu_probe_reason_on_this_machine():
    probe = xpu_platform.probe()
    assert not probe.usable
    assert probe.reason.startswith("no Intel GPU: torch.xpu.is_available() is False"), probe.reason
    if not torch.xpu._is_compiled():
        assert "built without XPU support" in probe.reason and xpu_platform.XPU_WHEEL_INDEX in probe.reason


def test_xpu_probe_refuses_a_triton_without_intel_backend(monkeypatch):
    """With a device visible, the probe checks the installed Triton for an Intel backend (this one is CUDA/ROCm)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    monkeypatch.setattr(torch.xpu, "device_count", lambda: 1)
    monkeypatch.setattr(torch.xpu, "get_device_name", lambda i=0: "Intel Arc B580")
    probe = xpu_platform.probe()
    assert not probe.usable and probe.device_name == "Intel Arc B580"
    assert "no Intel XPU backend" in probe.reason or "needs the `triton` package" in probe.reason, probe.reason


def test_plugins_load_and_import_nothing_vendor():
    out = run_scenario("imports", interpret=False)
    assert out["modules"] == [], out  # neither triton nor intel_extension_for_pytorch was imported
    assert not out["xpu"]["usable"] and "torch.xpu.is_available() is False" in out["xpu"]["reason"]
    assert not out["ipex"]["usable"] and "intel-extension-for-pytorch is not installed" in out["ipex"]["reason"]
    assert not out["xpu"]["error"] and not out["ipex"]["error"]


def test_backends_command_lists_xpu_and_ipex_with_reasons():
    found = discover()
    assert found["xpu"].distribution == found["ipex"].distribution == "pagedllm-xpu"
    res = subprocess.run([sys.executable, "-m", "pagedllm.cli", "backends"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    lines = {ln.split()[0]: ln for ln in res.stdout.splitlines() if ln.strip()}
    assert "torch.xpu.is_available() is False" in lines["xpu"], res.stdout
    assert "intel-extension-for-pytorch" in lines["ipex"], res.stdout
    code = "import torch, pagedllm_xpu.plugin, pagedllm_xpu.ipex_plugin; torch.ones(2).sum()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_ipex_version_guard_reads_metadata_only(monkeypatch):
    """The guard's decisions from the installed version string alone (nothing is imported here)."""
    import importlib.metadata as md

    def installed(version):
        monkeypatch.setattr(ipex_vendor.md, "version", lambda dist: version)

    installed("2.8.0+cpu")
    s = ipex_vendor.check("2.13.0+cpu")
    assert not s.ok and "built for torch 2.8.x" in s.reason and "2.13.0+cpu" in s.reason
    installed("2.13.10+xpu")
    assert not ipex_vendor.check("2.13.0").ok and "XPU build" in ipex_vendor.check("2.13.0").reason
    installed("2.13.0+cpu")
    assert ipex_vendor.check("2.13.1+cpu").ok
    assert not ipex_vendor.check("2.1.0").ok  # 2.13 vs 2.1: compared as numbers, not string prefixes

    def missing(dist):
        raise md.PackageNotFoundError(dist)

    monkeypatch.setattr(ipex_vendor.md, "version", missing)
    assert "not installed" in ipex_vendor.check().reason
    assert "intel_extension_for_pytorch" not in sys.modules
