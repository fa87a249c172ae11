"""``pagedllm bench gguf-parity FILE...``: pagedllm's native (packed) path on GGUF files written by llama.cpp's own
converter and ``llama-quantize`` (``ci/make_1p7b_ggufs.sh``), against the same file dequantized at load by
``gguf.quants.dequantize`` (``quantization="none"``, float32): which kernel each weight type runs on, and whether the
greedy first tokens are equal. Exit status 1 when a linear fell back to the dequantized reference or a token differs.
"""

from __future__ import annotations

import gc
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from pagedllm.sampling_params import SamplingParams

PROMPT = "The history of the city begins in the year"


@dataclass
class FileParity:
    path: str
    kernels: dict[str, int]  # "<weight type> -> <kernel>" -> linears
    packed: list[int]  # greedy tokens, native path
    reference: list[int]  # greedy tokens, dequantized float32
    first_difference: Optional[int] = None  # index of the first differing token
    reference_margin: Optional[float] = None  # reference's top-1 minus top-2 logprob there (a near-tie if small)
    fallbacks: list[str] = field(default_factory=list)  # weight types dequantized at load on the native path

    @property
    def ok(self) -> bool:
        return self.first_difference is None and not self.fallbacks


def _greedy(llm: Any, prompt: list[int], tokens: int) -> tuple[list[int], list[dict]]:
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, logprobs=2),
                       use_tqdm=False)[0].outputs[0]
    return list(out.token_ids), out.logprobs


def check_file(path: str, tokens: int = 16, prompt: str = PROMPT, device: str = "cpu") -> FileParity:
    """Greedy ``tokens`` after ``prompt`` on the native path, then on the dequantized reference (one at a time:
    a 1.7B reference is 4 bytes a weight)."""
    from pagedllm import LLM  # heavy: torch
    from pagedllm.quantization import QuantizedLinear  # heavy: torch

    kw = dict(device=device, max_model_len=256, kv_cache_memory=256 << 20)  # a 1.7B model: ~650 fp32 tokens
    llm = LLM(path, **kw)
    ids = llm.get_tokenizer().encode(prompt)
    kernels = Counter(f"{m.weight_type} -> {m.kernel_name}" for m in llm.llm_engine.model.modules()
                      if isinstance(m, QuantizedLinear))
    fallbacks = sorted({m.weight_type for m in llm.llm_engine.model.modules()
                        if isinstance(m, QuantizedLinear) and m.kernel_name.startswith("reference")})
    packed, _ = _greedy(llm, ids, tokens)
    del llm
    gc.collect()
    ref = LLM(path, **kw, dtype="float32", quantization="none")
    reference, ref_lps = _greedy(ref, ids, tokens)
    del ref
    gc.collect()
    res = FileParity(path, dict(kernels), packed, reference, fallbacks=fallbacks)
    diff = [i for i, (a, b) in enumerate(zip(packed, reference)) if a != b]
    if diff:
        i = res.first_difference = diff[0]
        top = sorted((lp.logprob for lp in ref_lps[i].values()), reverse=True)
        res.reference_margin = top[0] - top[1] if len(top) > 1 else None
    return res


def add_parser(sub) -> None:
    p = sub.add_parser("gguf-parity", help="GGUF files (e.g. llama.cpp-quantized K-quants): native packed kernels "
                                           "and greedy tokens equal to the file dequantized to float32")
    p.add_argument("files", nargs="+", metavar="FILE.gguf")
    p.add_argument("--tokens", type=int, default=16, help="greedy tokens compared (default 16)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.set_defaults(func=main)


def main(args) -> int:
    results = []
    for path in args.files:
        r = check_file(path, args.tokens, args.prompt, args.device)
        results.append(r)
        kern = ", ".join(f"{k} x{n}" for k, n in sorted(r.kernels.items()))
        if r.ok:
            verdict = f"greedy {args.tokens} tokens equal"
        elif r.fallbacks:
            verdict = f"NOT packed: {', '.join(r.fallbacks)} dequantized at load"
        else:
            margin = "n/a" if r.reference_margin is None else f"{r.reference_margin:.4f}"
            verdict = (f"token {r.first_difference} differs ({r.packed[r.first_difference]} vs "
                       f"{r.reference[r.first_difference]}; reference top-2 logprob margin {margin})")
        print(f"{'ok  ' if r.ok else 'FAIL'} {path}: {kern}; {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(asdict(r), ok=r.ok) for r in results], f, indent=1)
    return 0 if all(r.ok for r in results) else 1
