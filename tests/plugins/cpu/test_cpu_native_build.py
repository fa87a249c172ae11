"""The CPU plugin builds its C++ ops under the machine-wide build lock (``pagedllm.backend.build_lock``): a process
that waited for another's build takes its library instead of compiling again, and the lock's holder removes what a
killed build left. The compiler is replaced by a recorder here (whether it is called is the point; the real build runs
in this folder's other tests through ``native.get``), except where the sources are compiled as the portable build
would."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from build_lock_utils import holder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("PAGEDLLM_CACHE", str(tmp_path))
    return tmp_path


def test_a_second_build_waits_and_takes_the_first_ones_result(cache, monkeypatch):
    """The CPU plugin's ``_compile``: under the lock, a library another process built meanwhile is taken as is."""
    from pagedllm_cpu import native

    target = cache / "torch-ext" / "lib.so"
    target.parent.mkdir(parents=True)
    stale = target.parent / "build-killed"  # what a killed build leaves
    stale.mkdir()
    p, release = holder("pagedllm_cpu", then_write=str(target))
    compiled: list[bool] = []
    monkeypatch.setattr("torch.utils.cpp_extension.load", lambda **kw: compiled.append(True))
    t = threading.Thread(target=native._compile, args=(target,))
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting for the first build, not building
    release.set()
    t.join(30)
    p.join(10)
    assert not t.is_alive() and target.read_bytes() == b"built" and compiled == []
    assert stale.is_dir()  # nothing built here, nothing cleaned
    target.unlink()
    with pytest.raises(FileNotFoundError):  # now it builds (the stub builds nothing to rename) and cleans first
        native._compile(target)
    assert compiled == [True] and not stale.exists() and not list(target.parent.glob("build-*"))




def test_missing_ops_are_named_in_one_line_and_a_failed_build_leaves_nothing(cache):
    """A fresh machine whose ops are not built: one warning line with the cost and the command that builds them
    ahead; the build itself (here: no working compiler) fails to the torch paths, leaving no temporary folder."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PAGEDLLM_CACHE": str(cache), "CXX": "/bin/false"}
    code = ("import logging; logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
            "from pagedllm_cpu import native\nnative.start_build(); native._thread.join()\n"
            "print('lib', native.lib)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "lib None" in out.stdout, out.stderr[-2000:]
    missing = [line for line in out.stderr.splitlines() if "are not built" in line]
    assert len(missing) == 1 and "`pagedllm-cpu-build`" in missing[0] and "min" in missing[0], out.stderr
    assert not list((cache / "torch-ext").glob("build-*"))
    cli = subprocess.run([sys.executable, "-m", "pagedllm_cpu.native"], capture_output=True, text=True, timeout=300,
                         env=env)
    assert cli.returncode == 1 and cli.stderr.count("\n") == 1, cli.stderr
    assert cli.stderr.startswith("pagedllm-cpu-build: could not build the C++ ops"), cli.stderr


def test_sources_with_per_function_simd_levels_build_without_isa_flags():
    """The portable build (``DEFAULT``: a CPU without AVX2, or ``ATEN_CPU_CAPABILITY=default``) compiles every file
    with no ``-mavx*`` flag; files that pick their SIMD level at run time carry it in function target attributes, and
    an intrinsic reached without one (a lambda inside such a function inherits none) does not inline there, failing
    the whole library. Compiled with the portable build's flags but at -O0 (quicker; always-inline intrinsics are
    inlined at every level)."""
    import subprocess
    import sysconfig
    from concurrent.futures import ThreadPoolExecutor

    from pagedllm_cpu import native
    from torch.utils.cpp_extension import include_paths

    sources = [s for s in native._SOURCES if "__attribute__((target" in s.read_text()]
    assert len(sources) >= 3  # the runtime-dispatch kernels (kquant_gemv, q8act_gemv, stream_read, ...)
    flags = ["-std=c++20"] + ["-O0" if f == "-O3" else f for f in native.cflags("DEFAULT")]
    flags += [arg for p in [sysconfig.get_paths()["include"], *include_paths()] for arg in ("-I", p)]

    def compile_one(src):
        return src.name, subprocess.run(["c++", *flags, "-c", "-o", "/dev/null", str(src)], capture_output=True,
                                        text=True, timeout=300)

    with ThreadPoolExecutor(2) as pool:
        for name, out in pool.map(compile_one, sources):
            assert out.returncode == 0, f"{name}: {out.stderr[-1500:]}"
