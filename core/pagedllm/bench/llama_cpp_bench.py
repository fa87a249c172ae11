"""A current llama.cpp as a peer: one ``llama-bench`` run (built by ``ci/setup_llamacpp_peer.sh``) per call, so
``pagedllm bench latency --llama-bench PATH`` can alternate it with pagedllm's own runs on the same GGUF file and
threads.

Each call is one repeat (``-r 1``, after llama-bench's own warm-up) of either token generation (``-p 0 -n N``, from
an empty context) or prompt processing (``-p N -n 0``); the rate comes from llama-bench's JSON output, its build
number and commit beside it, and the child's peak RSS (``VmHWM``, read until it exits: ``wait4``'s figure includes
the peak of the process that started it, ``proc_mem.peak_rss_bytes``).

Seen on a 2-core Xeon VM with AMX (b11434, ``GGML_NATIVE``): every batched matmul on ggml's AMX buffer type
(prompt processing, the depth run of ``-d``) dies (SIGILL on ``tilezero`` or SIGSEGV) while batch-1 generation
runs; ``--repack 0`` (no extra buffer types: neither AMX nor the AVX repacks) runs. ``run_llama_bench`` raises
:class:`LlamaBenchFault` when the process dies of a signal, so a caller can retry a test with ``--repack 0`` and
say so beside its figure.

"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Sequence

from pagedllm.proc_mem import peak_rss_bytes

#: Where ``ci/setup_llamacpp_peer.sh`` builds by default (its ``bin/`` holds llama-bench, llama-quantize,
#: llama-perplexity and the converter wrapper); ``PAGEDLLM_LLAMA_CPP`` names another build.
DEFAULT_BUILD = os.path.expanduser("~/.cache/pagedllm/llama.cpp-b11434")


def llama_cpp_bin(tool: str) -> str:
    """Path of ``tool`` in the peer build (``PAGEDLLM_LLAMA_CPP`` or :data:`DEFAULT_BUILD`); it may not exist."""
    return os.path.join(os.environ.get("PAGEDLLM_LLAMA_CPP", DEFAULT_BUILD), "bin", tool)


@dataclass
class LlamaBenchRun:
    tok_s: float  # llama-bench's rate of this repeat
    peak_rss_bytes: int  # of the llama-bench process (weights are mmapped: the pages it touched count)
    build: str  # "b<number> (<commit>)"
    model_type: str  # llama.cpp's description, e.g. "llama 1B Q4_K - Medium"
    n_threads: int


class LlamaBenchFault(RuntimeError):
    """llama-bench died of a signal (SIGILL / SIGSEGV), not of a usage error."""


def cpu_kind() -> str:
    """The CPU's model name and the instruction sets that choose kernels (what every figure must name)."""
    name, flags = "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and name == "unknown":
                    name = val.strip()
                elif key.strip() == "flags":
                    flags = set(val.split())
                    break
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags]
    return f"{name} ({' '.join(isa) or 'no AVX2'}), {os.cpu_count()} CPUs"


def llama_bench_command(binary: str, model: str, threads: int, n_prompt: int, n_gen: int, depth: int = 0,
                        repeats: int = 1, extra_args: Sequence[str] = ()) -> list[str]:
    """tg: ``n_prompt`` 0, ``n_gen`` N; pp: ``n_prompt`` N, ``n_gen`` 0 (one test per call); ``-d`` only when
    ``depth`` is set."""
    return [binary, "-m", model, "-p", str(n_prompt), "-n", str(n_gen), *(["-d", str(depth)] if depth else []),
            "-t", str(threads), "-r", str(repeats), *extra_args, "-o", "json"]


def wait_with_peak_rss(pid: int, interval_s: float = 0.05) -> tuple[int, int]:
    """Reap child ``pid``: (its wait status, the peak RSS of its own address space in bytes, 0 if never read).
    The peak only grows, so the last read before exit (``interval_s`` apart) stands for the whole run."""
    peak = 0
    while True:
        peak = max(peak, peak_rss_bytes(pid) or 0)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, peak
        time.sleep(interval_s)


def run_llama_bench(binary: str, model: str, threads: int, n_prompt: int, n_gen: int, depth: int = 0,
                    extra_args: Sequence[str] = ()) -> LlamaBenchRun:
    """One llama-bench repeat of one test; its rate, the process's peak RSS and llama.cpp's build."""
    cmd = llama_bench_command(binary, model, threads, n_prompt, n_gen, depth, extra_args=extra_args)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err)
        try:
            status, peak_rss = wait_with_peak_rss(proc.pid)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode < 0:
        raise LlamaBenchFault(f"llama-bench died of signal {-proc.returncode}: {' '.join(cmd)} (where ggml's AMX "
                              "path faults, e.g. a batched test on an AMX VM, '--repack 0' runs)")
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited {proc.returncode}: {' '.join(cmd)}\n{stderr[-2000:]}")
    try:
        (row,) = json.loads(stdout)
    except ValueError as e:
        raise RuntimeError(f"llama-bench printed no single JSON result: {stdout[-1000:]!r}") from e
    return LlamaBenchRun(tok_s=float(row["avg_ts"]), peak_rss_bytes=peak_rss,
                         build=f"b{row['build_number']} ({row['build_commit']})", model_type=row["model_type"],
                         n_threads=int(row["n_threads"]))
