"""Teacher-forced logit parity with HF through the paged cache (and the state slots of models with recurrent state):
the schedules, the runner and the tolerance shared by the per-family model tests (native, fallback, MoE, MLA,
Falcon, GLM, GGUF, remote layouts, quantization, LFM2, Qwen3-Next, Mamba2, Granite-4.0-H)."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import KVCacheSpec, MambaSpec
from pagedllm.models import CausalLM
from tiny_models import make_fallback_model

BLOCK_SIZE = 4
PROMPT_LENS = (20, 17)  # both longer than the mistral/qwen2_swa sliding window (8) and than one block

# Schedules over two sequences A=0 and B=1: per step, (seq, new tokens), decodes (1 token) first.
FULL_PREFILL = [[(0, 20), (1, 17)]]
CHUNKED = [
    [(0, 7), (1, 5)],  # two first chunks
    [(0, 1), (1, 6)],  # a decode beside a chunk with cached context
    [(1, 1), (0, 5)],  # and the other way round
    *[[(0, 1), (1, 1)]] * 5,  # batched decodes; B ends after these
    *[[(0, 1)]] * 2,  # A decodes alone
]


def parity_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENS]


def run_schedule(model: CausalLM, backend, prompts: list[list[int]], schedule) -> list[torch.Tensor]:
    """Teacher-forced run of ``schedule`` through the paged cache; returns each prompt's logits ``[len, vocab]``.
    A model with recurrent state gets state slots too: sequence s owns slot s + 1, every slot starts as garbage (a
    fresh chunk must not read it), flagged fresh on its first chunk only."""
    blocks_per_seq = [(len(p) + BLOCK_SIZE - 1) // BLOCK_SIZE for p in prompts]
    ids = list(range(1, sum(blocks_per_seq) + 1))  # block 0 stays unused; tables are scattered on purpose
    random.Random(0).shuffle(ids)
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(ids[start:start + n])
        start += n
    spec = KVCacheSpec(model.num_layers, sum(blocks_per_seq) + 1, BLOCK_SIZE, model.num_kv_heads, model.head_size,
                       torch.float32, torch.device("cpu"), mla=getattr(model, "kv_cache_mla", False))
    model.kv_caches = backend.allocate_kv_cache(spec)
    stateful = getattr(model, "num_state_layers", 0) > 0
    if stateful:
        model.state_caches = backend.allocate_state_cache(MambaSpec(
            model.num_state_layers, len(prompts) + 1, model.state_shapes, model.state_dtypes, torch.device("cpu")))
        for layer in model.state_caches:
            for t in layer:
                t.normal_()
    done = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    for step in schedule:
        qlens = [n for _, n in step]
        slens = [done[s] + n for s, n in step]
        tokens = [t for s, n in step for t in prompts[s][done[s]:done[s] + n]]
        positions = [p for s, n in step for p in range(done[s], done[s] + n)]
        meta = AttentionMetadata.build(qlens, slens, [tables[s] for s, _ in step], BLOCK_SIZE)
        if stateful:
            meta.state_indices = torch.tensor([s + 1 for s, _ in step], dtype=torch.int32)
            meta.has_initial_state = torch.tensor([done[s] > 0 for s, _ in step])
        hidden = model(torch.tensor(tokens), torch.tensor(positions), meta)
        logits = model.compute_logits(hidden)
        for i, (s, n) in enumerate(step):
            rows[s].append(logits[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]])
            done[s] += n
    assert done == [len(p) for p in prompts], "schedule must cover every prompt token"
    return [torch.cat(r) for r in rows]


def assert_logits_match(name: str, got, expected) -> None:
    """fp32 logits within 1e-4 of HF at every position, with the same argmax; prints the max error seen."""
    for g, e in zip(got, expected):
        err = (g - e).abs().max().item()
        print(f"{name}: max |logit diff| = {err:.2e} (logit std {e.std().item():.2f})")
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        assert torch.equal(g.argmax(-1), e.argmax(-1))


def assert_schedules_match_hf(name: str, hf, model, backend, prompts: list[list[int]]) -> None:
    """``model``'s logits through the full-prefill and the chunked schedule, each as ``hf``'s over whole prompts."""
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
    for schedule in (FULL_PREFILL, CHUNKED):
        assert_logits_match(name, run_schedule(model, backend, prompts, schedule), expected)


def hf_eager(path: str):
    """The HF model on the same weights: fp32, eager attention, eval mode."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def family_dirs(tmp_path_factory, label: str, names) -> dict[str, str]:
    """Each named tiny config of ``tiny_models.make_fallback_model`` saved once under a ``label`` folder."""
    root = tmp_path_factory.mktemp(label)
    return {name: make_fallback_model(name, root / name) for name in names}
