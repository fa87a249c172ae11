"""The CPU plugin's C++ ops (``csrc/*.cpp``, one library): built on first use, cached on disk, optional.

``paged_decode.cpp`` attends decodes in place; ``rms_norm.cpp``, ``rotary.cpp``, ``silu_and_mul.cpp`` and
``write_kv.cpp`` do in one op call what takes torch two to twenty at decode sizes, where dispatch and temporaries cost
more than the arithmetic (``ops.py`` and ``attention.py`` call them when loaded, else their torch paths); ``q4_gemv.cpp`` runs GGUF Q4_0 / Q4_1 linears,
``q8_gemv.cpp`` Q8_0 ones and a tied LM head over a Q8_0 embedding, ``kquant_gemv.cpp`` Q4_K / Q5_K / Q6_K ones
with fp32 activations, ``kquant_r16.cpp`` the K-quants repacked into 16-row groups with x in two int8 terms (CPUs
with AVX-512 VNNI); ``q8act_gemv.cpp`` (Q8_0 / Q4_0 / Q4_1) and ``kquant_q8k.cpp`` (K-quants) the same with int8
activations for few rows (``quant.py``; these pick their own SIMD level at run time, every level compiled in with
function target attributes). ``stream_read.cpp`` is the streaming-read bandwidth probe (``stream_read(buf) ->
checksum``) that ``pagedllm bench latency`` finds in torch's op registry as ``torch.ops.pagedllm_cpu.stream_read``
for its decode floor; ``matmul_peak.cpp`` the CPU's bf16 peak (AMX tile dot products, else AVX512-BF16 vector ones, on
every thread, ``matmul_peak(seconds) -> TFLOP/s``, 0 with neither) that ``pagedllm bench throughput --gemm-ceiling`` states beside a
bf16 step's linears. ``cpu_common.h`` holds what several kernels share.

Built with ``torch.utils.cpp_extension`` (g++, ninja) for the SIMD level ATen itself detected
(``torch.backends.cpu.get_cpu_capability()``: AVX512, AVX2, or the portable default), never by the machine's name.
Built when the project is set up (``pagedllm-cpu-build``, which ``ci/setup.sh`` runs). When it is still missing at
run time, one warning line says so with the cost and that command, and the build (1-2 min on 2 cores) runs in a
background thread started at engine start, so a cold start is not slowed: until it is ready, or when no compiler is
available, decodes take the gather + SDPA path. One build per machine: it runs under the machine-wide build lock
(``pagedllm.backend.build_lock``; processes started together wait for the first one's result instead of building
again), in a temporary folder renamed into the cache, and the lock's holder removes any temporary folder a killed
build left. With ``PAGEDLLM_WAIT_FOR_BUILDS=1`` (``pagedllm bench`` sets it) the engine waits for the build instead of
measuring the fallback. ``PAGEDLLM_CPU_PAGED_DECODE=0`` turns the library off (benchmarks).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from pagedllm.backend import build_lock, cache_root, wait_requested

logger = logging.getLogger(__name__)

_SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
_HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # included by the sources: part of the build key
_ENV = "PAGEDLLM_CPU_PAGED_DECODE"
_LOCK = "pagedllm_cpu"  # the build lock's name (``pagedllm bench`` names it while it is held)
BUILD_COMMAND = "pagedllm-cpu-build"
#: Compiler flags per ATen CPU capability: the macros select at::vec's implementation, -m flags allow its instructions.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2"],
}

_lock = threading.Lock()
_thread: Optional[threading.Thread] = None
_op: Optional[Callable] = None
#: ``torch.ops.pagedllm_cpu`` once the library is loaded (its ops: ``rms_norm``, ``rotary``, ``write_kv``...), else None.
lib: Optional[Any] = None
_error: Optional[str] = None


def enabled() -> bool:
    return os.environ.get(_ENV, "1") not in ("0", "false", "off")


def _capability() -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    return cap if cap in _ISA_FLAGS else "DEFAULT"


def _build_key(cap: str) -> str:
    h = hashlib.sha256()
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    h.update(f"{torch.__version__}:{sys.version_info[:2]}:{cap}".encode())
    return h.hexdigest()[:20]


def library_path() -> Path:
    """Where the built kernel for this torch, Python and capability lives (``PAGEDLLM_CACHE`` moves it)."""
    cap = _capability()
    return cache_root() / "torch-ext" / f"pagedllm_cpu-{cap.lower()}-{_build_key(cap)}.so"


def cflags(cap: str) -> list[str]:
    """The compiler flags of the library built for SIMD level ``cap`` (AVX512, AVX2, DEFAULT)."""
    return ["-O3", "-fopenmp", "-ffp-contract=off", f"-DCPU_CAPABILITY={cap}"] + _ISA_FLAGS.get(cap, [])


def _compile(target: Path) -> None:
    """Build into ``target`` under the machine-wide lock, unless the lock's previous holder built it meanwhile."""
    from torch.utils import cpp_extension

    cap = _capability()
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(_LOCK):
        if target.is_file():  # built by the process we waited for
            return
        for stale in target.parent.glob("build-*"):  # only a killed build leaves one: nobody else builds now
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix="build-", dir=target.parent))
        try:
            name = f"pagedllm_cpu_ops_{cap.lower()}"
            cpp_extension.load(name=name, sources=[str(s) for s in _SOURCES], build_directory=str(tmp),
                               is_python_module=False, extra_cflags=cflags(cap),
                               extra_ldflags=["-fopenmp"], verbose=False)
            os.replace(tmp / f"{name}.so", target)  # atomic: another process sees the whole file or none
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _load() -> None:
    global _op, lib, _error
    try:
        target = library_path()
        if not target.is_file():
            _compile(target)
        if not hasattr(torch.ops.pagedllm_cpu, "paged_decode_attention"):  # (a fresh build loaded it already)
            torch.ops.load_library(str(target))
        _op = torch.ops.pagedllm_cpu.paged_decode_attention
        lib = torch.ops.pagedllm_cpu
        logger.info("CPU C++ ops ready (%s, %s)", _capability(), target)
    except Exception as e:  # no compiler, no ninja, no headers, read-only cache...: the SDPA path stays
        lines = str(e).strip().splitlines() or [""]
        _error = f"{type(e).__name__}: {next((x for x in lines if 'error' in x), lines[-1]).strip()}"
        logger.warning("CPU C++ kernels unavailable (%s); decodes use the gather + SDPA path, the other ops torch",
                       _error)


def start_build() -> None:
    """Load the library from the cache now (milliseconds), or build it in a background thread (once per process;
    no-op when off). Loading a cached build synchronously keeps every step of a process on one path: decodes of
    processes that compare logits (TP ranks, DP replicas, a reference engine) must not switch mid-run."""
    global _thread
    if not enabled():
        return
    with _lock:
        if _thread is None:
            built = library_path().is_file()
            if not built:
                logger.warning("CPU C++ ops are not built for this torch and CPU (%s): building them now in the "
                               "background (1-2 min on 2 cores; decodes run several times slower until then). "
                               "Build them ahead with `%s`.", _capability(), BUILD_COMMAND)
            _thread = threading.Thread(target=_load, name="pagedllm-cpu-kernel-build", daemon=True)
            _thread.start()
            if built or wait_requested():
                _thread.join()


def get(wait: bool = False, timeout: Optional[float] = None) -> Optional[Callable]:
    """The op ``paged_decode_attention(out, query, kv_cache, block_tables, seq_lens, scale, window, soft_cap,
    alibi_slopes, sinks=None)`` if it is ready, else None; starts the build if nobody has. ``wait`` blocks until it is
    done."""
    if not enabled():
        return None
    if _op is not None:
        return _op
    start_build()
    if wait and _thread is not None:
        _thread.join(timeout)
    return _op


def error() -> Optional[str]:
    """Why the kernel could not be loaded, or None."""
    return _error


def main() -> int:
    """``pagedllm-cpu-build``: build (or find) the C++ ops for this torch and CPU now, so no engine builds them."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    target = library_path()
    if not enabled():
        print(f"{_ENV}=0: the C++ ops are off; nothing to build")
        return 0
    if target.is_file():
        print(f"CPU C++ ops already built ({_capability()}): {target}")
        return 0
    t0 = time.monotonic()
    try:
        _compile(target)
    except Exception as e:  # noqa: BLE001 - reported in one line; the engine falls back to torch ops
        lines = str(e).strip().splitlines() or [""]
        print(f"pagedllm-cpu-build: could not build the C++ ops: {type(e).__name__}: "
              f"{next((x for x in lines if 'error' in x), lines[-1]).strip()}", file=sys.stderr)
        return 1
    print(f"CPU C++ ops built ({_capability()}) in {time.monotonic() - t0:.0f} s: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
