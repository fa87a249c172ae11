"""The partner conformance suite on known-good, known-bad and third-party-packaged backends."""

from __future__ import annotations

import argparse
import csv
import importlib
import importlib.metadata as md
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from pagedllm.backend.registry import Backend, discover
from pagedllm.conformance import run_conformance
from pagedllm.conformance import cli as conformance_cli
from plugin_factory import make_plugin


def off_by_one_attention(query, kv_cache, meta, scale, sliding_window, soft_cap):
    """Reference semantics, but position p's block is looked up at table index (p + 1) // block_size: wrong only
    for the last slot of each block, the kind of bug that passes casual tests."""
    bs, hkv, d = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    group = query.shape[1] // hkv
    flat_k, flat_v = kv_cache[0].reshape(-1, hkv, d), kv_cache[1].reshape(-1, hkv, d)
    out = torch.empty_like(query)
    qsl = meta.query_start_loc_cpu
    for i, s in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        pos = torch.arange(s)
        idx = ((pos + 1) // bs).clamp(max=meta.block_tables.shape[1] - 1)
        slots = meta.block_tables[i, idx].long() * bs + pos % bs
        k = flat_k[slots].float().repeat_interleave(group, 1)
        v = flat_v[slots].float().repeat_interleave(group, 1)
        scores = torch.einsum("lhd,shd->hls", query[start:end].float(), k) * scale
        q_pos = torch.arange(s - (end - start), s)[:, None]
        scores = scores.masked_fill(~(pos[None, :] <= q_pos)[None], float("-inf"))
        out[start:end] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v).to(query.dtype)
    return out


def write_kv_ignoring_padding(key, value, kv_cache, slot_mapping):
    """Forgets that slot -1 means "skip": padding tokens land in the cache's last slot."""
    _, nb, bs, h, d = kv_cache.shape
    kv_cache[0].view(nb * bs, h, d)[slot_mapping] = key
    kv_cache[1].view(nb * bs, h, d)[slot_mapping] = value


def rediscover() -> dict:
    """Re-read entry points (a package was just (un)installed), keeping backends registered in-process."""
    kept = {k: v for k, v in discover().items() if v.distribution.startswith("<")}
    found = discover(refresh=True)
    for k, v in kept.items():
        found.setdefault(k, v)
    return found


def test_reference_backend_passes_everything(ref_backend, tmp_path):
    report = run_conformance(ref_backend, report_dir=str(tmp_path))
    na = [r for r in report.results if r.not_applicable]  # dtypes, fp8 KV and quantization it does not declare
    assert {r.error for r in na} >= {"capabilities do not declare dtype bfloat16",
                                     "capabilities do not declare quantization gguf"}
    n = len(report.results) - len(na)
    # it implements no op hook: everything but memory_info ran core's reference code, counted apart
    assert report.passed and report.counts() == {"passing": n, "failing": 0, "untested": 0,
                                                 "not_applicable": len(na), "reference_fallback": n - 1}
    assert report.status == "PASS"
    assert report.features() == {"memory": "verified-on-hardware", "kv_cache": "reference-fallback",
                                 "attention": "reference-fallback", "fused_ops": "reference-fallback",
                                 "graph": "reference-fallback", "e2e": "reference-fallback",
                                 "state": "reference-fallback",
                                 "quantization": "not-applicable", "dtype": "not-applicable"}
    kernels = {r.kernel for r in report.results}
    assert {"write_kv", "paged_attention.decode", "paged_attention.prefill", "paged_attention.mixed",
            "paged_attention.sliding_window", "paged_attention.soft_cap", "paged_attention.alibi", "gather_kv_blocks",
            "swap_kv_blocks", "allocate_kv_cache", "memory_info", "rms_norm", "rotary", "silu_and_mul",
            "graph_runner.replay_vs_eager", "greedy_parity_vs_hf", "layout_ownership", "add_lora",
            "apply_token_bitmask"} <= kernels
    models = {r.model for r in report.results if r.kernel == "paged_attention.mixed"}
    assert models == {f"hs{hs}-bs16-gqa{g}" for hs in (64, 128) for g in (1, 3, 4)}  # from default Capabilities
    data = json.loads((tmp_path / "conformance-ref.json").read_text())
    assert data["counts"]["passing"] == n and data["counts"]["reference_fallback"] == n - 1
    rows = list(csv.DictReader((tmp_path / "conformance-ref.csv").open()))
    assert len(rows) == len(report.results) and {(r["status"], r["not_applicable"]) for r in rows} == {
        ("passing", "False"), ("untested", "True")}
    text = (tmp_path / "conformance-ref.md").read_text()
    assert "| attention | paged_attention.decode | ref fallback 6/6 |" in text
    assert "## Reference fallback" in text and "1 passing on the backend's own hooks" in text


def test_wrong_kernels_are_caught_and_reported():
    bad = Backend(make_plugin("buggy", paged_attention=off_by_one_attention, write_kv=write_kv_ignoring_padding),
                  "buggy")
    report = run_conformance(bad, allow=["paged_attention.*", "write_kv"])
    assert not report.passed
    alibi = [r for r in report.results if r.kernel == "paged_attention.alibi"]  # not declared by this plugin
    assert alibi and all(r.status == "untested" and "do not declare alibi" in r.error for r in alibi)
    attention = [r for r in report.results if r.kernel.startswith("paged_attention") and not r.not_applicable]
    assert attention and all(r.status == "failing" for r in attention), [(r.id, r.status) for r in attention]
    assert all("outside atol" in r.error or "NaN" in r.error for r in attention)
    # the attention cases were filled by core's reference write (canonical layout), so only the attention bug shows
    # there, located as the guide promises: sequence, position, block, offset, head
    for r in attention:
        assert "cache filled by core's reference write_kv" in r.error, r.error
        assert all(w in r.error for w in ("sequence ", "position ", "block ", "offset ", "head ")), r.error
    write = [r for r in report.results if r.kernel == "write_kv"]
    assert write and all(r.status == "failing" and "where the reference is NaN" in r.error for r in write)
    assert all("no input token (a slot that must stay unwritten)" in r.error for r in write), write[0].error
    others = [r for r in report.results if r.feature not in ("attention",) and r.kernel != "write_kv"
              and not r.not_applicable]
    assert all(r.status == "untested" and r.error == "not in the allowlist" for r in others)
    md_text = report.to_markdown()
    assert "**FAIL**" in md_text and "| attention | paged_attention.decode | FAIL 6/6 |" in md_text


def lora_first_run_slot_everywhere(y, x, lora_a, lora_b, mapping):
    """Batches the step's runs as if they all used the first run's adapter (a slot-indexing bug)."""
    s0 = mapping.runs[0][0]
    for _, lo, hi in mapping.runs:
        y[lo:hi] += (x[lo:hi] @ lora_a[s0].t()) @ lora_b[s0].t()


def bitmask_ignoring_width(logits, bitmask):
    """Unpacks the mask but lets tokens past the mask's width through (tokenizer vocab < model vocab)."""
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :logits.shape[-1]]
    logits[:, :allowed.shape[1]].masked_fill_(~allowed, float("-inf"))


def test_wrong_lora_and_bitmask_kernels_are_caught():
    bad = Backend(make_plugin("buggy2", add_lora=lora_first_run_slot_everywhere,
                              apply_token_bitmask=bitmask_ignoring_width), "buggy2")
    report = run_conformance(bad, allow=["add_lora", "apply_token_bitmask"])
    status = {r.id: r.status for r in report.results if r.kernel in ("add_lora", "apply_token_bitmask")}
    assert status == {"add_lora[uniform|float32]": "failing", "add_lora[uneven|float32]": "failing",
                      "add_lora[uniform_consecutive|float32]": "failing",
                      "apply_token_bitmask[w96|float32]": "failing", "apply_token_bitmask[w128|float32]": "passing"}


def test_tolerance_overrides_and_exclusions():
    def loose_silu(x):
        return F.silu(x[..., : x.shape[-1] // 2]) * x[..., x.shape[-1] // 2:] * (1 + 2e-3)

    be = Backend(make_plugin("loose", silu_and_mul=loose_silu), "loose")
    strict = run_conformance(be, allow=["silu_and_mul", "rms_norm"], exclude=["rms_norm"])
    silu = next(r for r in strict.results if r.kernel == "silu_and_mul")
    assert silu.status == "failing" and "atol=0.0001" in silu.error
    rms = next(r for r in strict.results if r.kernel == "rms_norm")
    assert rms.status == "untested" and rms.error == "excluded by 'rms_norm'"
    relaxed = run_conformance(be, allow=["silu_and_mul"], tolerances={"silu_and_mul": (1e-2, 1e-2)})
    assert relaxed.passed and next(r for r in relaxed.results if r.kernel == "silu_and_mul").status == "passing"


def test_cuda_and_rocm_are_installed_but_not_usable_here():
    found = discover()
    for name, vendor in (("cuda", "CUDA"), ("rocm", "ROCm")):
        assert name in found, sorted(found)
        item = found[name]
        assert item.backend is not None, item.error
        assert item.distribution == f"pagedllm-{name}" and item.backend.info.device_type == "cuda"
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            probe = item.backend.probe
            assert not probe.usable and vendor in probe.reason and torch.__version__ in probe.reason, probe
    out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "backends", "--json"], check=True,
                         capture_output=True, text=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["cuda"]["usable"] is False and rows["cuda"]["reason"]
    assert rows["rocm"]["usable"] is False and rows["rocm"]["reason"]


# ---- a vendor's package, built and installed the way a partner ships one --------------------------------------------
VENDOR_PLUGIN = '''
"""Acme's pagedllm backend: a torch SiLU-and-mul of its own; everything else falls back to core's reference."""
import torch
from pagedllm.backend.hookspec import BackendInfo, Capabilities, MemoryInfo, ProbeResult, hookimpl


@hookimpl
def pagedllm_backend_info():
    return BackendInfo(name="acme", device_type="cpu", priority=-1, description="third-party test backend")


@hookimpl
def pagedllm_probe():
    return ProbeResult(True, device_name="acme virtual device")


@hookimpl
def pagedllm_capabilities():
    return Capabilities(dtypes=("float32", "bfloat16"), head_sizes=(64,), block_sizes=(16,), sliding_window=True,
                        soft_cap=True, mla=True)  # core's reference attention and MLA run for it


@hookimpl
def pagedllm_memory_info(device):
    return MemoryInfo(total_bytes=2 << 30, free_bytes=1 << 30)


@hookimpl
def pagedllm_silu_and_mul(x):
    a, b = x.chunk(2, dim=-1)
    return (torch.nn.functional.silu(a.float()) * b.float()).to(x.dtype)
'''

VENDOR_PYPROJECT = '''
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "acme-pagedllm-backend"
version = "0.0.1"
dependencies = ["pagedllm"]

[project.entry-points."pagedllm.backends"]
acme = "acme_pagedllm_backend"

[tool.setuptools]
packages = ["acme_pagedllm_backend"]
'''


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True)


@pytest.fixture(scope="module")
def vendor_backend(tmp_path_factory):
    src = tmp_path_factory.mktemp("acme_src")
    (src / "pyproject.toml").write_text(textwrap.dedent(VENDOR_PYPROJECT))
    (src / "acme_pagedllm_backend").mkdir()
    (src / "acme_pagedllm_backend" / "__init__.py").write_text(VENDOR_PLUGIN)
    _pip("install", "--no-deps", "--no-build-isolation", str(src))
    importlib.invalidate_caches()
    try:
        yield "acme"
    finally:
        _pip("uninstall", "-y", "acme-pagedllm-backend")
        importlib.invalidate_caches()
        rediscover()


def test_vendor_package_is_discovered_and_passes_conformance(vendor_backend, tmp_path):
    found = rediscover()
    item = found[vendor_backend]
    assert item.distribution == "acme-pagedllm-backend" and item.backend is not None, item.error
    assert "site-packages" in sys.modules["acme_pagedllm_backend"].__file__  # installed, not from the repo
    assert item.backend.implements("pagedllm_silu_and_mul")
    listing = subprocess.run([sys.executable, "-m", "pagedllm.cli", "backends"], check=True, capture_output=True,
                             text=True).stdout
    assert "acme" in listing
    report = run_conformance(vendor_backend, report_dir=str(tmp_path))
    assert report.passed, [(r.id, r.error) for r in report.failing]
    assert report.counts()["untested"] == 0


def test_cli_entry_writes_the_support_matrix(vendor_backend, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    conformance_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["conformance", "--device", vendor_backend, "--report", str(tmp_path), "-q",
                              "--allow", "silu_and_mul", "rms_norm", "--tolerance", "bfloat16=5e-2,5e-2"])
    rediscover()
    assert args.func(args) == 0
    out = capsys.readouterr().out
    # an allowlist leaves declared cases unrun: the run is PARTIAL, never PASS
    assert "**PARTIAL**" in out and "| fused_ops | silu_and_mul | pass | pass |" in out
    assert "| fused_ops | rms_norm | ref fallback | ref fallback |" in out  # acme leaves it to core
    assert {p.name for p in tmp_path.iterdir()} == {f"conformance-acme.{e}" for e in ("md", "json", "csv")}
    missing = parser.parse_args(["conformance", "--device", "no-such-backend", "-q"])
    assert missing.func(missing) == 2


def test_pytest_entry_point(vendor_backend, tmp_path):
    """``pytest --pyargs pagedllm.conformance --conformance-device acme`` (plugin via the pytest11 entry point, else
    -p); the option is namespaced so the plugin claims no generic ``--device`` in other pytest runs."""
    registered = any(ep.value == "pagedllm.conformance.pytest_plugin" for ep in md.entry_points(group="pytest11"))
    plugin = [] if registered else ["-p", "pagedllm.conformance.pytest_plugin"]
    cmd = [sys.executable, "-m", "pytest", *plugin, "--pyargs", "pagedllm.conformance", "--conformance-device",
           vendor_backend,
           "-q", "-p", "no:cacheprovider", "--conformance-allow", "write_kv", "--conformance-allow", "rms_norm",
           "--conformance-report", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "4 passed" in res.stdout and "skipped" in res.stdout, res.stdout[-2000:]
    text = (tmp_path / "conformance-acme.md").read_text()
    assert "| kv_cache | write_kv | ref fallback | ref fallback |" in text
