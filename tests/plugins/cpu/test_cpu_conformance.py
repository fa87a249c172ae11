"""The CPU backend, dynamic (``cpu``) and static-bucket (``cpu-static``), passes the full partner conformance suite,
run exactly as a partner would: the CLI; the two JSON reports then generate a support matrix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def conformance(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedllm.cli", "conformance", *args], capture_output=True,
                          text=True, timeout=900)


@pytest.mark.parametrize("device", ["cpu", "cpu-static"])
def test_pagedllm_conformance_passes_and_writes_support_matrix(tmp_path, device):
    res = conformance("--device", device, "--report", str(tmp_path), "-q")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "**PASS**" in res.stdout
    files = sorted(p.name for p in tmp_path.iterdir())
    assert {f"conformance-{device}.{e}" for e in ("md", "json", "csv")} <= set(files), files
    report = json.loads((tmp_path / f"conformance-{device}.json").read_text())
    assert report["status"] == "PASS" and report["verification"] == "verified-on-hardware"
    rows = report["results"]
    # Cases the backend's capabilities rule out (a quantized weight type it has no kernel for) are not run.
    assert rows and all(r["status"] == "passing" or r["not_applicable"] for r in rows)
    assert sum(r["status"] == "passing" for r in rows) > 100
    kernels = {r["kernel"] for r in rows}
    assert {"write_kv", "paged_attention.decode", "paged_attention.prefill", "paged_attention.mixed",
            "greedy_parity_vs_hf", "graph_runner.replay_vs_eager", "layout_ownership"} <= kernels, sorted(kernels)
    e2e = next(r for r in rows if r["kernel"] == "greedy_parity_vs_hf")
    assert "bs128" in e2e["model"] and "prompt lengths [5, 129, 386]" in e2e["detail"]  # several blocks of 128
    static = [r for r in rows if r["feature"] == "static_shapes"]
    if device == "cpu-static":
        (row,) = static
        assert "distinct shapes seen of" in row["detail"]
        assert "BucketPolicy" in next(r for r in rows if r["kernel"] == "graph_runner.replay_vs_eager")["detail"]
    else:
        assert not static


def test_support_matrix_from_cpu_reports(tmp_path):
    """``--simulated`` marks a run verified-on-CPU-simulation; the matrix shows it, and lists backends without a
    report as not verified. The runs are partial on purpose: one cheap feature each (the full runs, end to end
    included, are the test above)."""
    a = conformance("--device", "cpu", "--report", str(tmp_path), "-q", "--allow", "fused_ops")
    b = conformance("--device", "cpu-static", "--report", str(tmp_path), "-q", "--allow", "fused_ops",
                    "--simulated", "test: pretend simulated layer")
    assert a.returncode == b.returncode == 0, a.stderr[-2000:] + b.stderr[-2000:]
    out = tmp_path / "matrix.md"
    res = conformance("--support-matrix", str(out), "--from-reports", str(tmp_path / "conformance-cpu.json"),
                      str(tmp_path / "conformance-cpu-static.json"), "--backends", "cpu", "cpu-static", "tpu")
    assert res.returncode == 0, res.stderr
    rows = {line.split(" | ")[0].strip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    assert "PARTIAL" in rows["cpu"] and "verified on hardware" in rows["cpu"]
    assert "verified on CPU simulation" in rows["cpu-static"] and "verified on hardware" not in rows["cpu-static"]
    assert "no report" in rows["tpu"]
