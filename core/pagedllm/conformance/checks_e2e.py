"""End to end, at every block size the backend accepts: generation through ``pagedllm.LLM`` on the backend, its top-k
log-probabilities at every prompt and generated position against core's reference backend (a stated tolerance), and
its greedy tokens against HF transformers on the same tiny random weights (float32, so they must match exactly).
Prompts span several blocks of the block size under test, so an off-by-one block offset cannot hide in block 0, and
the logprobs catch one that leaves greedy tokens unchanged."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from types import SimpleNamespace
from typing import Iterator

import torch

from pagedllm.backend.hookspec import BackendInfo, Capabilities, MemoryInfo, ProbeResult, hookimpl
from pagedllm.backend.registry import Backend, Discovered, discover
from pagedllm.conformance.harness import CaseContext, CheckFailed, Untested

MAX_TOKENS = 8


@lru_cache(maxsize=None)
def tiny_llama(head_size: int, seed: int = 0, max_positions: int = 256) -> str:
    """A seeded random 2-layer GQA Llama saved with ``save_pretrained`` (cached per process)."""
    from transformers import AutoModelForCausalLM, LlamaConfig  # heavy: transformers

    config = LlamaConfig(vocab_size=128, hidden_size=4 * head_size, intermediate_size=8 * head_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_size,
                         max_position_embeddings=max_positions, initializer_range=0.15, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tempfile.mkdtemp(prefix="pagedllm-conformance-llama-")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    return path


def hf_greedy(path: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM  # heavy: transformers

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 pad_token_id=0)[0, len(p):]
            outs.append(ids.tolist())
    return outs


@contextmanager
def selected_by_name(backend: Backend) -> Iterator[None]:
    """Make ``device=backend.name`` resolve to this very Backend object while the engine is built."""
    registry = discover()
    old = registry.get(backend.name)
    registry[backend.name] = Discovered(backend.name, "<conformance>", backend)
    try:
        yield
    finally:
        if old is None:
            registry.pop(backend.name, None)
        else:
            registry[backend.name] = old


def e2e_prompts(ctx: CaseContext, block_size: int) -> list[list[int]]:
    """Short, just past one block, and past three blocks (decoding then crosses further boundaries)."""
    prompts = [[int(t) for t in ctx.randint(125, n).tolist()] for n in (5, block_size + 1, 3 * block_size + 2)]
    return [[t + 3 for t in p] for p in prompts]  # no special tokens inside prompts


def e2e_max_len(block_size: int) -> int:
    return 4 * block_size + 2 * MAX_TOKENS


def first_mismatch(got: list[int], want: list[int], prompt_len: int, block_size: int, seq: int) -> str:
    """Names the first bad sequence, position and block (a token id has no head: the logits mix them all)."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    pos = prompt_len + i
    return (f"sequence {seq} (prompt {prompt_len} tokens): first bad generated token {i} at position {pos}, "
            f"block {pos // block_size} offset {pos % block_size} (head: all, a token mixes every head); "
            f"generated {got}, reference {want}")


#: Top-k logprobs compared per position, prompt and generated, and the stated absolute tolerance on them (float32
#: kernels may sum in another order: ~1e-5 here; a wrong key or value read anywhere moves them by far more).
TOP_K = 5
LOGPROB_ATOL = 1e-3


def reference_backend(block_size: int) -> Backend:
    """Core's reference ops on the host: every optional hook left to ``pagedllm.backend.reference``."""
    @hookimpl
    def pagedllm_backend_info():
        return BackendInfo(name=REFERENCE_NAME, device_type="cpu", priority=-100)

    @hookimpl
    def pagedllm_probe():
        return ProbeResult(True, device_name="host CPU (core's reference ops)")

    @hookimpl
    def pagedllm_capabilities():
        return Capabilities(dtypes=("float32",), head_sizes=None, block_sizes=(block_size,))

    @hookimpl
    def pagedllm_memory_info(device):
        return MemoryInfo(total_bytes=8 << 30, free_bytes=4 << 30)

    plugin = SimpleNamespace(pagedllm_backend_info=pagedllm_backend_info, pagedllm_probe=pagedllm_probe,
                             pagedllm_capabilities=pagedllm_capabilities, pagedllm_memory_info=pagedllm_memory_info)
    return Backend(plugin, REFERENCE_NAME)


REFERENCE_NAME = "conformance-reference"


def generate(backend: Backend, path: str, prompts: list[list[int]], bs: int, **engine) -> list:
    """Greedy generation with top-k logprobs of every prompt and generated position."""
    from pagedllm import LLM, SamplingParams  # heavy: the engine stack, not at CLI start

    with selected_by_name(backend):
        llm = LLM(model=path, device=backend.name, dtype="float32", block_size=bs, skip_tokenizer_init=True,
                  max_model_len=e2e_max_len(bs), max_num_seqs=4, **engine)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=TOP_K, prompt_logprobs=TOP_K)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), list(o.prompt_logprobs or []), list(o.outputs[0].logprobs or []), llm)
            for o in outs]


def logprob_mismatch(got: dict | None, want: dict | None, tol: float) -> str:
    """'' when two positions' top-k logprobs agree within ``tol`` (a token in one top-k only must sit at the other's
    boundary, a near-tie); else what differs."""
    if not want:
        return ""
    if not got:
        return f"no logprobs, reference top-{len(want)} {_fmt(want)}"
    g = {t: float(v.logprob) for t, v in got.items()}
    w = {t: float(v.logprob) for t, v in want.items()}
    for t in sorted(g.keys() & w.keys()):
        if not abs(g[t] - w[t]) <= tol:
            return f"token {t}: logprob {g[t]:.6f}, reference {w[t]:.6f} (tolerance {tol:g}); reference {_fmt(want)}"
    for mine, other, who in ((w, g, "reference's"), (g, w, "backend's")):
        for t in mine.keys() - other.keys():
            if not mine[t] <= min(other.values()) + tol:
                return (f"token {t} ({mine[t]:.6f}) is in the {who} top-k only, above the other's lowest "
                        f"{min(other.values()):.6f}; backend {_fmt(got)}, reference {_fmt(want)}")
    return ""


def _where(pos: int, bs: int) -> str:
    return f"position {pos}, block {pos // bs} offset {pos % bs} (head: all, a logprob mixes every head)"


def _fmt(d: dict) -> str:
    ranked = sorted(d.items(), key=lambda x: -x[1].logprob)
    return "{" + ", ".join(f"{t}: {float(v.logprob):.4f}" for t, v in ranked) + "}"


def check_e2e(ctx: CaseContext) -> None:
    """Through ``pagedllm.LLM`` on the backend at one block size: top-k logprobs of every prompt and generated
    position against core's reference backend (within :data:`LOGPROB_ATOL`), then greedy tokens against HF."""
    try:
        import pagedllm.entrypoints.llm  # noqa: F401  heavy: the engine stack, not at CLI start
    except ImportError as e:
        raise Untested(f"pagedllm.LLM is not importable yet: {e}") from e
    bs = ctx.params["block_size"]
    tol = max(LOGPROB_ATOL, ctx.atol)
    path = tiny_llama(ctx.params["head_size"], max_positions=e2e_max_len(bs))
    prompts = e2e_prompts(ctx, bs)
    got = generate(ctx.backend, path, prompts, bs)
    blocks = 4 * (-(-e2e_max_len(bs) // bs)) + 2
    ref = generate(reference_backend(bs), path, prompts, bs, num_gpu_blocks_override=blocks)
    for i, ((g_tok, g_plp, g_lp, _), (r_tok, r_plp, r_lp, _)) in enumerate(zip(got, ref)):
        for pos, (a, b) in enumerate(zip(g_plp, r_plp)):
            bad = logprob_mismatch(a, b, tol)
            if bad:
                raise CheckFailed(f"sequence {i}: prompt logprobs of the token at position {pos}, computed at "
                                  f"{_where(pos - 1, bs)}, against core's reference backend: {bad}")
        n = next((k for k, (a, b) in enumerate(zip(g_tok, r_tok)) if a != b), len(r_tok))
        for k, (a, b) in enumerate(zip(g_lp[:n + 1], r_lp[:n + 1])):
            bad = logprob_mismatch(a, b, tol)
            if bad:
                pos = len(prompts[i]) + k
                raise CheckFailed(f"sequence {i} (prompt {len(prompts[i])} tokens): logprobs of generated token {k} "
                                  f"(position {pos}), computed at {_where(pos - 1, bs)}, against core's reference "
                                  f"backend: {bad}")
    want = hf_greedy(path, prompts)
    for i, ((g_tok, *_), w) in enumerate(zip(got, want)):
        if g_tok != w:
            raise CheckFailed(first_mismatch(g_tok, w, len(prompts[i]), bs, i))
    engine = got[0][3].llm_engine
    level = getattr(engine, "graph_level", None) or getattr(getattr(engine, "worker", None), "graph_level", "?")
    ctx.notes.append(f"block size {bs}, prompt lengths {[len(p) for p in prompts]}, graph level {level}; top-{TOP_K} "
                     f"prompt and generated logprobs within {tol:g} of core's reference backend, greedy tokens equal "
                     f"to HF's")
