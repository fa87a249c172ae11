"""One build of a plugin's compiled ops per machine (issue 32: three processes once built at once, and every figure
taken meanwhile ran at a tenth of the real speed): the build lock, who sees it held, that a killed holder leaves no
lock behind, and that ``pagedllm bench`` refuses to measure while a build runs. Real processes. The CPU plugin's
use of it: tests/plugins/cpu/test_cpu_native_build.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.backend import build_lock
from pagedllm.backend.builds import running
from build_lock_utils import holder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    return tmp_path


def test_a_held_lock_is_seen_by_others_and_released_by_a_killed_holder(cache):
    assert running() == []
    p, release = holder("demo_ops")
    assert running() == ["demo_ops"]
    p.kill()  # a build killed mid-way (Ctrl-C, OOM): the kernel drops its flock
    p.join(10)
    assert running() == []
    with build_lock("demo_ops"):  # and the next build takes it at once
        assert running() == ["demo_ops"]  # (this process's own build counts too)


def test_bench_refuses_while_a_build_runs(cache):
    p, release = holder("pagedllm_cpu")
    try:
        out = subprocess.run([sys.executable, "-m", "pagedllm.cli", "bench", "throughput", "--num-prompts", "1"],
                             capture_output=True, text=True, timeout=120, env={**os.environ})
    finally:
        release.set()
        p.join(10)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "a build of compiled ops is running" in out.stderr and "pagedllm_cpu" in out.stderr, out.stderr
