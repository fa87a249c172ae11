"""``pagedllm bench quant``: the issue-12 table (docs/benchmarks.md) for the embedded SmolLM2 GGUF on the CPU backend.

float32 dense (``--quantization none``), bfloat16 dense (``--dtype bfloat16``), Q4_1 packed (the default) and INT8
W8A8 (the same weights dequantized to an fp32 folder, then made compressed-tensors W8A8 by round-to-nearest),
alternated over ``--rounds`` rounds; batch-1 decode (1 prompt x 16 -> 128 tokens) and batch-64 throughput
(64 x 32 -> 64), each ``bench throughput`` in its own process so peak RSS and cold start are per configuration. Then
the llama.cpp anchor (``bench llama-cpp``) when ``--llama-python`` points at a Python with gpt4all 2.8.2.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
from pathlib import Path

from pagedllm.bench.llama_cpp import peer_command
from pagedllm.bench.peer import hf_folder
from pagedllm.bench.server_process import PAGEDLLM

CONFIGS = ("fp32", "q4_1", "bf16", "w8a8")  # run order; the table lists fp32, bf16, q4_1, w8a8
THROUGHPUT = [*PAGEDLLM, "bench", "throughput", "--device", "cpu", "--max-model-len", "512", "--kv-cache-memory",
              "268435456"]
BATCH_1 = ["--num-prompts", "1", "--input-len", "16", "--output-len", "128", "--repeats", "3"]
BATCH_64 = ["--num-prompts", "64", "--input-len", "32", "--output-len", "64", "--repeats", "2"]


def add_parser(sub) -> None:
    p = sub.add_parser("quant", help="embedded SmolLM2: fp32 / bf16 / Q4_1 / W8A8, one process per run, alternated "
                                     "rounds (+ llama.cpp anchor)")
    p.add_argument("--output-dir", default="/tmp/bench-quant", help="per-run JSON and the W8A8 folder go here")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--llama-python", default=os.environ.get("LLAMA_PY"),
                   help="a Python with gpt4all==2.8.2 for the llama.cpp anchor (default: $LLAMA_PY; none: skipped)")
    p.set_defaults(func=main)


def w8a8_folder(out: str) -> str:
    """The embedded model's weights as compressed-tensors W8A8 (round-to-nearest), made once under ``out``."""
    folder = os.path.join(out, "smollm2-w8a8")
    if not os.path.exists(os.path.join(folder, "config.json")):
        from pagedllm.models.paths import default_model_path  # heavy: torch, not at CLI start
        from pagedllm.quantization.rtn import quantize_folder  # heavy: torch, not at CLI start

        quantize_folder(hf_folder(str(default_model_path())), folder, "w8a8")
    return folder


def _run_quietly(cmd: list[str]) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def run_rounds(out: str, rounds: int, llama_python: str | None) -> None:
    flags = {"fp32": ["--quantization", "none"], "q4_1": [], "bf16": ["--dtype", "bfloat16"],
             "w8a8": ["--model", w8a8_folder(out)]}
    for r in range(1, rounds + 1):
        for cfg in CONFIGS:
            _run_quietly([*THROUGHPUT, *flags[cfg], *BATCH_1, "--json", f"{out}/b1-{cfg}-{r}.json"])
            _run_quietly([*THROUGHPUT, *flags[cfg], *BATCH_64, "--json", f"{out}/b64-{cfg}-{r}.json"])
        if llama_python:
            _run_quietly(peer_command(llama_python, None, 128, 3, len(os.sched_getaffinity(0)),
                                      f"{out}/llamacpp-{r}.json"))


def summary(out: str) -> str:
    """The markdown table of every run's JSON in ``out`` (per round, ``/``-separated), then the anchor's lines."""
    def load(pattern: str) -> list[dict]:
        return [json.loads(Path(f).read_text()) for f in sorted(glob.glob(f"{out}/{pattern}"))]

    def col(rows: list[dict], key: str, fmt: str) -> str:
        return " / ".join(format(r[key], fmt) for r in rows)

    lines = ["| config | batch-1 decode tok/s (per round) | batch-64 output tok/s (per round) | peak RSS MB (b1) "
             "| cold start s (b1) |", "|---|---|---|---|---|"]
    for cfg in ("fp32", "bf16", "q4_1", "w8a8"):
        b1, b64 = load(f"b1-{cfg}-*.json"), load(f"b64-{cfg}-*.json")
        lines.append(f"| {cfg} | {col(b1, 'output_tok_s', '.1f')} | {col(b64, 'output_tok_s', '.0f')} | "
                     f"{col(b1, 'peak_rss_mb', '.0f')} | {col(b1, 'cold_start_s', '.1f')} |")
    for r in load("llamacpp-*.json"):
        lines.append(f"llama.cpp (gpt4all 2.8.2): decode median {r['median_decode_tok_s']:.1f} tok/s, "
                     f"load {r['load_s']:.2f} s")
    return "\n".join(lines)


def main(args) -> int:
    os.makedirs(args.output_dir, exist_ok=True)
    run_rounds(args.output_dir, args.rounds, args.llama_python)
    print(summary(args.output_dir))
    return 0
