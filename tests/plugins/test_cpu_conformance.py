"""The CPU backend passes the partner conformance suite, run exactly as a partner would: the CLI."""

from __future__ import annotations

import json
import subprocess
import sys


def test_pagedllm_conformance_cpu_passes_and_writes_support_matrix(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pagedllm.cli", "conformance", "--device", "cpu", "--report",
                          str(tmp_path), "-q"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    assert {"conformance-cpu.md", "conformance-cpu.json", "conformance-cpu.csv"} <= set(files), files
    report = json.loads((tmp_path / "conformance-cpu.json").read_text())
    rows = report["results"]
    assert rows and all(r["status"] == "passing" for r in rows)
    kernels = {r["kernel"] for r in rows}
    assert {"write_kv", "paged_attention.decode", "paged_attention.prefill", "paged_attention.mixed",
            "greedy_parity_vs_hf"} <= kernels, sorted(kernels)
