"""``pagedllm bench llama-cpp-perplexity``: llama.cpp's ``llama-perplexity`` and pagedllm on the same GGUF file,
the same text and the very same tokens (llama.cpp's own tokenization, read back from the file its
``--kl-divergence-base`` writes), scored llama-perplexity's way: the text in chunks of ``--ctx`` tokens, the first
replaced by BOS when the vocabulary adds one, and only each chunk's second half scored (the first half is context).
The issue's goal: pagedllm's perplexity within 0.5% of llama.cpp's.

``--f32-peer`` also scores, with llama-perplexity, the file dequantized to F32 by llama.cpp's own ``llama-quantize``
(beside llama-perplexity): ggml multiplies quantized weights by activations quantized to 8 bits (Q8_0 / Q8_1 /
Q8_K), pagedllm's default kernels by float32 activations, so the F32 figure separates that rounding of llama.cpp's
from any error of pagedllm's packed kernels (which equal the dequantized weights).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import tempfile
from typing import Any, Sequence

import numpy as np

from pagedllm.bench.perplexity import text
from pagedllm.sampling_params import SamplingParams

_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+)")


def read_base_tokens(path: str) -> tuple[int, list[list[int]]]:
    """(n_ctx, chunks of token ids) from llama-perplexity's ``--kl-divergence-base`` file: ``_logits_``, n_ctx,
    n_vocab, n_chunk (int32 each), then n_chunk * n_ctx int32 tokens (the log-probabilities follow)."""
    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path}: not a llama-perplexity logits file")
        n_ctx, _n_vocab, n_chunk = np.frombuffer(f.read(12), dtype="<i4").tolist()
        toks = np.frombuffer(f.read(4 * n_ctx * n_chunk), dtype="<i4").reshape(n_chunk, n_ctx)
    return n_ctx, toks.tolist()


def run_llama_perplexity(binary: str, model: str, text_file: str, ctx: int, chunks: int, threads: int,
                         base_file: str, extra_args: Sequence[str] = ()) -> float:
    cmd = [binary, "-m", model, "-f", text_file, "-c", str(ctx), "-b", str(ctx), "--chunks", str(chunks),
           "-t", str(threads), "--kl-divergence-base", base_file, *extra_args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    m = _FINAL.search(p.stdout + p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"llama-perplexity failed ({p.returncode}): {' '.join(cmd)}\n"
                           f"{(p.stdout + p.stderr)[-2000:]}")
    return float(m.group(1))


def llama_perplexity_f32(binary: str, model: str, tmp: str, text_file: str, ctx: int, chunks: int, threads: int,
                         extra_args: Sequence[str], tokens: list[list[int]]) -> float:
    """llama-perplexity on ``model`` dequantized to F32 by the ``llama-quantize`` beside ``binary``; the tokens must
    be the quantized run's (same vocabulary, same text), which is checked."""
    quantize = os.path.join(os.path.dirname(binary), "llama-quantize")
    f32 = os.path.join(tmp, "f32.gguf")
    p = subprocess.run([quantize, "--allow-requantize", model, f32, "F32"], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{quantize} --allow-requantize {model} F32 failed ({p.returncode}): "
                           f"{(p.stdout + p.stderr)[-2000:]}")
    base = os.path.join(tmp, "base-f32.bin")
    ppl = run_llama_perplexity(binary, f32, text_file, ctx, chunks, threads, base, extra_args)
    if read_base_tokens(base)[1] != tokens:
        raise RuntimeError("llama-perplexity tokenized the text differently for the F32 file")
    os.unlink(f32)
    return ppl


def chunked_perplexity(llm: Any, chunks: list[list[int]], bos: int | None) -> float:
    """llama-perplexity's estimate on ``chunks``: per chunk (first token -> BOS when ``bos``), the mean NLL of the
    tokens after position n_ctx/2 given everything before them."""
    nll, count = 0.0, 0
    for chunk in chunks:
        ids = [bos, *chunk[1:]] if bos is not None else list(chunk)
        first = len(ids) // 2
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
        lps = [out.prompt_logprobs[j][ids[j]].logprob for j in range(first + 1, len(ids))]
        nll -= math.fsum(lps)
        count += len(lps)
    return math.exp(nll / count)


def add_parser(sub) -> None:
    p = sub.add_parser("llama-cpp-perplexity", help="llama.cpp's llama-perplexity vs pagedllm on the same GGUF "
                                                    "file, text and tokens")
    p.add_argument("--llama-perplexity", required=True, metavar="PATH",
                   help="llama-perplexity (ci/setup_llamacpp_peer.sh)")
    p.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2 Q4_1)")
    p.add_argument("--text", default="license", help="pep20, license (the interpreter's LICENSE.txt) or a file")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk (llama-perplexity -c)")
    p.add_argument("--chunks", type=int, default=4, help="chunks scored (the text needs ctx * max(2, chunks) tokens)")
    p.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: torch's)")
    p.add_argument("--llama-args", default=None, metavar="ARGS",
                   help="extra llama-perplexity options, e.g. '--no-repack' where ggml's AMX path faults "
                        "(llama_cpp_bench)")
    p.add_argument("--f32-peer", action="store_true",
                   help="also run llama-perplexity on the file dequantized to F32 by llama-quantize (same tokens): "
                        "llama.cpp without its 8-bit activations; needs 4 bytes per weight on disk")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.set_defaults(func=main)


def main(args) -> int:
    import torch  # heavy: torch

    from pagedllm import LLM  # heavy: torch
    from pagedllm.errors import ParamError
    from pagedllm.models.paths import default_model_path  # heavy: torch

    model = args.model or str(default_model_path())
    if not str(model).endswith(".gguf"):
        raise ParamError("model", f"--model must be a GGUF file (llama-perplexity reads only GGUF); got {model}")
    if not os.access(args.llama_perplexity, os.X_OK):
        raise ParamError("llama_perplexity", f"--llama-perplexity: {args.llama_perplexity} is not executable "
                                             "(build it with ci/setup_llamacpp_peer.sh)")
    threads = args.threads or torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        text_file = os.path.join(tmp, "text.txt")
        with open(text_file, "w") as f:
            f.write(text(args.text))
        base = os.path.join(tmp, "base.bin")
        extra = shlex.split(args.llama_args or "")
        theirs = run_llama_perplexity(args.llama_perplexity, model, text_file, args.ctx, args.chunks, threads, base,
                                      extra)
        n_ctx, chunks = read_base_tokens(base)
        theirs_f32 = None
        if args.f32_peer:
            theirs_f32 = llama_perplexity_f32(args.llama_perplexity, model, tmp, text_file, args.ctx, args.chunks,
                                              threads, extra, chunks)
    # 1 GiB of KV: 2.7k float32 tokens of the 1.7B model
    llm = LLM(model, device=args.device, max_model_len=max(n_ctx + 8, 256), kv_cache_memory=1 << 30)
    tok = llm.get_tokenizer()
    # llama.cpp tokenized the text with its special tokens: it starts with BOS exactly when the vocabulary adds one,
    # and then every chunk's first token is replaced by BOS.
    bos = tok.bos_token_id if tok.bos_token_id is not None and chunks[0][0] == tok.bos_token_id else None
    ours = chunked_perplexity(llm, chunks, bos)
    res = dict(model=model, text=args.text, ctx=n_ctx, chunks=len(chunks),
               scored_tokens=len(chunks) * (n_ctx - n_ctx // 2 - 1), bos=bos, llama_cpp=theirs, pagedllm=ours,
               ratio=ours / theirs, quantization=llm.llm_engine.config.quantization)
    print(f"perplexity on {args.text} ({len(chunks)} chunks of {n_ctx} tokens, second halves scored, llama.cpp's "
          f"tokens): llama.cpp {theirs:.4f}, pagedllm ({res['quantization'] or 'dense'}) {ours:.4f}: "
          f"{100 * (ours / theirs - 1):+.2f}%")
    if theirs_f32 is not None:
        res.update(llama_cpp_f32=theirs_f32, ratio_f32=ours / theirs_f32)
        print(f"llama.cpp on the file dequantized to F32 (no 8-bit activations): {theirs_f32:.4f}; pagedllm "
              f"{100 * (ours / theirs_f32 - 1):+.2f}% from it; llama.cpp's quantized run "
              f"{100 * (theirs / theirs_f32 - 1):+.2f}% from it")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
