"""End to end: greedy generation through ``pagedllm.LLM`` on the backend equals HF transformers on the same tiny
random weights (float32, so the token sequences must match exactly). Prompts span several blocks of the block size
under test (the largest the backend declares), so an off-by-one block offset cannot hide in block 0."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

import torch

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


def check_greedy_parity(ctx: CaseContext) -> None:
    try:
        from pagedllm import LLM, SamplingParams  # heavy: the engine stack, not at CLI start
    except ImportError as e:
        raise Untested(f"pagedllm.LLM is not importable yet: {e}") from e
    bs = ctx.params["block_size"]
    path = tiny_llama(ctx.params["head_size"], max_positions=e2e_max_len(bs))
    prompts = e2e_prompts(ctx, bs)
    want = hf_greedy(path, prompts)
    with selected_by_name(ctx.backend):
        llm = LLM(model=path, device=ctx.backend.name, dtype="float32", block_size=bs,
                  skip_tokenizer_init=True, max_model_len=e2e_max_len(bs), max_num_seqs=4)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for i, (o, w) in enumerate(zip(outs, want)):
        got = list(o.outputs[0].token_ids)
        if got != w:
            raise CheckFailed(first_mismatch(got, w, len(prompts[i]), bs, i))
    engine = llm.llm_engine
    level = getattr(engine, "graph_level", None) or getattr(getattr(engine, "worker", None), "graph_level", "?")
    ctx.notes.append(f"block size {bs}, prompt lengths {[len(p) for p in prompts]}, graph level {level}")
