"""llama.cpp anchor for docs/benchmarks.md: batch-1 decode speed and load time of the embedded SmolLM2 Q4_1 GGUF
through the ``gpt4all`` 2.8.2 wheel (it ships llama.cpp's CPU backend).

Run by a SEPARATE venv's python (gpt4all must never go into the project venv), so it imports only gpt4all and the
standard library; ``pagedllm bench llama-cpp --python PY`` (and ``bench quant --llama-python PY``) start it by path:

    python3 -m venv /tmp/g4a && /tmp/g4a/bin/pip install gpt4all==2.8.2
    pagedllm bench llama-cpp --python /tmp/g4a/bin/python --tokens 128 --repeats 5 --threads 2

gpt4all's 2024 llama.cpp rejects the file's ``tokenizer.ggml.pre = "smollm"``; the script copies the file with that
value changed to ``"falcon"`` (same length; decode speed does not depend on the pre-tokenizer).
"""

# Lives beside vllm_peer.py, not in ci/: a peer driver started by path under the peer's own venv; pagedllm imports
# it only for add_options (its top level imports the standard library alone).
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import tempfile
import time

KEY = b"tokenizer.ggml.pre"


def patched_copy(src: str, dst_dir: str) -> str:
    """Copy ``src`` with tokenizer.ggml.pre "smollm" -> "falcon" (the key's string value, patched in place)."""
    dst = os.path.join(dst_dir, os.path.basename(src))
    shutil.copyfile(src, dst)
    with open(dst, "r+b") as f:
        head = f.read(1 << 20)
        at = head.index(struct.pack("<Q", len(KEY)) + KEY) + 8 + len(KEY)
        vtype, vlen = struct.unpack_from("<IQ", head, at)
        value = head[at + 12:at + 12 + vlen]
        if vtype != 8 or value not in (b"smollm", b"falcon"):
            raise SystemExit(f"unexpected tokenizer.ggml.pre: type {vtype}, value {value!r}")
        f.seek(at + 12)
        f.write(b"falcon")
    return dst


def add_options(p: argparse.ArgumentParser, gguf_help: str = "GGUF file", gguf_required: bool = True) -> None:
    """This script's options; ``pagedllm bench llama-cpp`` takes the same ones and passes them through."""
    p.add_argument("--gguf", required=gguf_required, default=None, help=gguf_help)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--cpu-time", action="store_true",
                   help="rate from the process's CPU time (with --threads 1) instead of wall time: for a "
                        "loaded machine")


def main() -> None:
    p = argparse.ArgumentParser()
    add_options(p)
    args = p.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    from gpt4all import GPT4All  # optional: gpt4all (the peer's own venv)

    with tempfile.TemporaryDirectory() as tmp:
        path = patched_copy(args.gguf, tmp)
        t = time.perf_counter()
        model = GPT4All(os.path.basename(path), model_path=tmp, allow_download=False, device="cpu",
                        n_threads=args.threads)
        load_s = time.perf_counter() - t
        rates = []
        for _ in range(args.repeats):
            n, first = 0, None
            for _tok in model.generate("Once upon a time", max_tokens=args.tokens, temp=0.0, streaming=True):
                n += 1
                if first is None:
                    first = clock()
            rates.append((n - 1) / (clock() - first))  # decode rate after the first token
        res = {"load_s": load_s, "decode_tok_s": rates, "median_decode_tok_s": statistics.median(rates),
               "tokens": args.tokens, "threads": args.threads}
    print(f"llama.cpp (gpt4all 2.8.2): load {load_s:.2f} s, batch-1 decode median "
          f"{res['median_decode_tok_s']:.1f} tok/s over {args.repeats} runs of {args.tokens} tokens "
          f"({', '.join(f'{r:.1f}' for r in rates)}), {args.threads} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
