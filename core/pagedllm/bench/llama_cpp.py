"""``pagedllm bench llama-cpp``: the 2024 llama.cpp anchor (``llama_cpp_peer.py``: gpt4all 2.8.2's build) under the
Python of a separate venv, on the embedded GGUF by default; ``bench quant`` runs it the same way. The current
llama.cpp peer (``ci/setup_llamacpp_peer.sh``) runs in ``bench latency --llama-bench``, its quality checks in
``bench gguf-parity`` (``llama_cpp_parity.py``) and ``bench llama-cpp-perplexity`` (``llama_cpp_perplexity.py``)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Optional

from pagedllm.bench.llama_cpp_peer import add_options

PEER_SCRIPT = Path(__file__).with_name("llama_cpp_peer.py")


def add_parser(sub) -> None:
    p = sub.add_parser("llama-cpp", help="the 2024 llama.cpp anchor (gpt4all 2.8.2, another venv): batch-1 decode on "
                                         "a GGUF file (the current llama.cpp: bench latency --llama-bench)")
    p.add_argument("--python", required=True, help="a Python with gpt4all==2.8.2 (never the project venv)")
    add_options(p, gguf_help="GGUF file (default: the embedded SmolLM2 Q4_1)", gguf_required=False)
    p.set_defaults(func=main)


def peer_command(python: str, gguf: Optional[str], tokens: int, repeats: int, threads: int,
                 json_path: Optional[str] = None, cpu_time: bool = False) -> list[str]:
    """The anchor's command line; ``gguf`` None means the embedded model."""
    if gguf is None:
        from pagedllm.models.paths import default_model_path  # heavy: torch, not at CLI start

        gguf = str(default_model_path())
    return [python, str(PEER_SCRIPT), "--gguf", gguf, "--tokens", str(tokens), "--repeats", str(repeats),
            "--threads", str(threads), *(["--json", json_path] if json_path else []),
            *(["--cpu-time"] if cpu_time else [])]


def main(args) -> int:
    cmd = peer_command(args.python, args.gguf, args.tokens, args.repeats, args.threads, args.json, args.cpu_time)
    return subprocess.run(cmd).returncode
