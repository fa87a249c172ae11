"""Loading says what it is doing: one stderr line per stage (resolving, reading weights, KV sizing with the block
count, warm-up, ready), a progress bar only on a terminal, nothing on stdout but the text; ``serve`` names the
quantization in use. The real CLI in a subprocess, its stderr read as a user's terminal or log would get it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from server_utils import ServerProcess, tiny_chat_model

STAGES = ("resolving model ", "reading weights: ", "weights read in ", "KV cache: ", "engine ready in ")


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.cli", *args]


def _env(**extra: str) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _stage_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if " pagedllm.startup: " in line]


def test_one_line_per_stage_in_a_log():
    p = subprocess.run(_cli("generate", "--model", tiny_chat_model(), "--device", "cpu", "--max-tokens", "4", "Hi"),
                       capture_output=True, text=True, timeout=180, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("Hi") and "pagedllm.startup" not in p.stdout  # stdout keeps the text only
    lines = _stage_lines(p.stderr)
    assert "\r" not in p.stderr and "%|" not in p.stderr, p.stderr  # no bar redrawn into a log
    assert [next(i for i, s in enumerate(STAGES) if s in line) for line in lines] == list(range(len(STAGES))), lines
    assert all(line.startswith("INFO ") for line in lines), lines
    assert "float32, not quantized" in lines[2], lines[2]
    blocks = int(re.search(r"KV cache: (\d+) blocks of 16 tokens \((\d+) tokens", lines[3]).group(1))
    assert f"blocks={blocks} " in lines[4], lines


def test_warm_up_is_a_stage():
    """A static backend warms up every bucket before serving: that stage has its line too, with the count."""
    p = subprocess.run(_cli("generate", "--model", tiny_chat_model(), "--device", "cpu-static", "--max-tokens", "2",
                            "--max-model-len", "32", "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "Hi"),
                       capture_output=True, text=True, timeout=300, env=_env())
    assert p.returncode == 0, p.stderr[-3000:]
    lines = _stage_lines(p.stderr)
    warm = [i for i, line in enumerate(lines) if "warming up on cpu-static: " in line]
    assert len(warm) == 1 and re.search(r"warming up on cpu-static: \d+ batch shapes, full graph capture$",
                                        lines[warm[0]]), lines
    assert "KV cache: " in lines[warm[0] - 1] and "engine ready in " in lines[warm[0] + 1], lines


def test_progress_bar_on_a_terminal():
    """With stderr on a terminal the weights stage draws a tqdm bar (then clears it for the summary line)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    proc = subprocess.Popen(_cli("generate", "--model", tiny_chat_model(), "--device", "cpu", "--max-tokens", "2",
                                 "Hi"), stdout=subprocess.PIPE, stderr=slave, env=_env())
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(180)
    os.close(master)
    text = seen.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"reading weights: +\d+%\|", text), text[-3000:]
    assert "weights read in " in text and "engine ready in " in text


def test_quiet_with_log_level_warning():
    p = subprocess.run(_cli("generate", "--model", tiny_chat_model(), "--device", "cpu", "--max-tokens", "2", "Hi"),
                       capture_output=True, text=True, timeout=180, env=_env(PAGEDLLM_LOG_LEVEL="WARNING"))
    assert p.returncode == 0 and not _stage_lines(p.stderr), p.stderr[-3000:]


@pytest.mark.slow
def test_serve_logs_the_quantization_in_use():
    """The embedded SmolLM2 GGUF (Q4_1) keeps its weights packed on the CPU backend's kernel; serve says so."""
    server = ServerProcess(None, "--max-model-len", "256", "--kv-cache-memory", str(64 << 20),
                           env={"OMP_NUM_THREADS": "1"})
    try:
        log = server.output()
    finally:
        server.stop()
    lines = _stage_lines(log)
    weights = [line for line in lines if "weights read in " in line]
    assert len(weights) == 1 and "GGUF Q4_1 packed" in weights[0], log[-3000:]
    assert any("KV cache: " in line for line in lines), log[-3000:]
