"""``pagedllm bench perplexity``: quality of each quantization path on a fixed real English text, against fp32.

Perplexity = exp(mean negative log-likelihood) of the text's tokens after the first, from teacher-forced prompt
logprobs (the engine's own prefill, so an fp8 KV cache is read back by every chunk). Texts available offline
everywhere: ``pep20`` (``this``, ~140 tokens) and ``license`` (the interpreter's ``LICENSE.txt``: the history of
Python and its license agreements, real English prose and legal text; the first ``--max-tokens`` tokens).
"""

from __future__ import annotations

import codecs
import contextlib
import io
import json
import os
import time
from typing import Any

from pagedllm import SamplingParams

#: name -> engine keyword arguments (beside model, device, max_model_len); the first is the reference.
CONFIGS: dict[str, dict[str, Any]] = {
    "fp32": dict(dtype="float32", quantization="none"),
    "bf16": dict(dtype="bfloat16", quantization="none"),
    "gguf-native": dict(),  # the checkpoint's own packed method (GGUF: Q4_1 on the int4 kernel)
    "fp8-weights": dict(dtype="float32", quantization="fp8"),
    "fp8-kv-e4m3": dict(dtype="float32", quantization="none", kv_cache_dtype="fp8_e4m3"),
    "fp8-kv-e5m2": dict(dtype="float32", quantization="none", kv_cache_dtype="fp8_e5m2"),
}


def text(name: str) -> str:
    if name == "pep20":
        with contextlib.redirect_stdout(io.StringIO()):
            import this  # noqa: F401  (prints the text on first import)
        return codecs.decode(this.s, "rot13")
    if name == "license":
        with open(os.path.join(os.path.dirname(os.__file__), "LICENSE.txt")) as f:
            return f.read()
    with open(name) as f:
        return f.read()


def add_parser(sub) -> None:
    p = sub.add_parser("perplexity", help="perplexity of fp32 / bf16 / packed / fp8 paths on a fixed text")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 Q4_1 GGUF")
    p.add_argument("--device", default="cpu")
    p.add_argument("--text", default="license", help="pep20, license (the interpreter's LICENSE.txt) or a file")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens of the text scored (from its start)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {', '.join(CONFIGS)}")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=main)


def perplexity(llm: Any, ids: list[int]) -> float:
    import torch  # heavy: torch

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    lps = [d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])]
    return float(torch.tensor(lps, dtype=torch.float64).mean().neg().exp())


def main(args) -> int:
    from pagedllm import LLM  # heavy: torch, not at CLI start

    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    ids: list[int] = []
    rows = []
    for name in names:
        t0 = time.perf_counter()
        llm = LLM(args.model, device=args.device, max_model_len=max(args.max_tokens + 8, 256),
                  kv_cache_memory=64 << 20, **CONFIGS[name])
        if not ids:
            ids = llm.get_tokenizer().encode(text(args.text))[: args.max_tokens]
        ppl = perplexity(llm, ids)
        cfg = llm.llm_engine.config
        rows.append(dict(config=name, perplexity=ppl, dtype=cfg.dtype, quantization=cfg.quantization,
                         kv_cache_dtype=cfg.kv_cache_dtype, seconds=time.perf_counter() - t0))
        del llm
    ref = rows[0]["perplexity"]
    for r in rows:
        r["vs_first"] = r["perplexity"] / ref - 1
    if args.json:
        print(json.dumps(dict(text=args.text, tokens=len(ids), rows=rows), indent=1))
        return 0
    print(f"text: {args.text}, {len(ids)} tokens; model: {args.model or 'embedded SmolLM2-135M Q4_1 GGUF'}")
    print(f"{'config':<14} {'weights':<12} {'dtype':<9} {'kv cache':<9} {'perplexity':>10} {'vs ' + rows[0]['config']:>9}")
    for r in rows:
        print(f"{r['config']:<14} {str(r['quantization'] or 'dense'):<12} {r['dtype']:<9} {r['kv_cache_dtype']:<9} "
              f"{r['perplexity']:>10.3f} {100 * r['vs_first']:>+8.2f}%")
    return 0
