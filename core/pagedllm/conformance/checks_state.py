"""Recurrent-state checks (contract v3): the causal conv1d hooks against ``pagedllm.backend.conv_ops`` on state
caches the backend allocated, and one end-to-end case where the state must be carried between chunked-prefill chunks
and decode steps: a tiny LFM2 through ``pagedllm.LLM`` on the backend with a token budget smaller than its prompts,
its top-k logprobs against core's reference backend and its greedy tokens against HF transformers."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache

import numpy as np
import torch

from pagedllm.backend import conv_ops
from pagedllm.backend.hookspec import MambaSpec
from pagedllm.conformance.checks_e2e import (TOP_K, e2e_max_len, e2e_prompts, first_mismatch, generate, hf_greedy,
                                             logprob_mismatch, reference_backend)
from pagedllm.conformance.harness import CaseContext, CheckFailed, NotApplicable, Untested

#: Per scenario: (sequence lengths, has_initial_state, slot of each; -1 a padding sequence). ``mixed`` continues
#: some sequences (one shorter than the kernel's history: the old state shifts through) and starts others fresh.
CONV_BATCHES = {"fresh": ([9, 1, 17], [False, False, False], [2, 0, 5]),
                "continue": ([4, 1, 23], [True, True, True], [1, 6, 3]),
                "mixed": ([2, 12, 3, 7], [True, False, True, False], [4, 0, -1, 7])}
NUM_SLOTS = 8


def _states(ctx: CaseContext, dim: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's conv-state tensor (from its allocator) filled with random state, and a reference copy."""
    spec = MambaSpec(1, NUM_SLOTS, ((dim, width - 1),), (ctx.dtype,), ctx.device)
    caches = ctx.backend.allocate_state_cache(spec)
    try:
        states = caches[0][0]
    except (TypeError, IndexError) as e:
        raise CheckFailed(f"allocate_state_cache: expected one tuple of tensors per layer, got {caches!r:.200}") \
            from e
    if not isinstance(states, torch.Tensor) or tuple(states.shape) != (NUM_SLOTS, dim, width - 1):
        raise CheckFailed(f"allocate_state_cache: expected a tensor of logical shape {(NUM_SLOTS, dim, width - 1)}, "
                          f"got {getattr(states, 'shape', type(states).__name__)}")
    states.copy_(ctx.randn(NUM_SLOTS, dim, width - 1))
    return states, states.detach().clone().contiguous()


def _weights(ctx: CaseContext, dim: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    return ctx.randn(dim, width, scale=0.5), ctx.randn(dim)


def check_causal_conv1d(ctx: CaseContext) -> None:
    """``causal_conv1d_fn`` over a batch of chunks (fresh, continuing, a padding sequence) against the reference:
    outputs and every slot of the state afterwards (slots of no sequence must be untouched)."""
    p = ctx.params
    dim, width = p["dim"], p["width"]
    lens, init, slots = CONV_BATCHES[p["scenario"]]
    states, ref_states = _states(ctx, dim, width)
    weight, bias = _weights(ctx, dim, width)
    x = ctx.randn(sum(lens), dim)
    dev = ctx.device
    qsl = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=dev)
    idx = torch.tensor(slots, dtype=torch.int32, device=dev)
    has_init = torch.tensor(init, dtype=torch.bool, device=dev)
    out = ctx.backend.causal_conv1d_fn(x, weight, bias, states, qsl, idx, has_init, p["activation"])
    ref = conv_ops.causal_conv1d_fn(x, weight, bias, ref_states, qsl, idx, has_init, p["activation"])
    bounds = qsl.tolist()
    real = [r for i, s in enumerate(slots) if s >= 0 for r in range(bounds[i], bounds[i + 1])]
    rows = torch.tensor(real, dtype=torch.long, device=dev)

    def where(i: tuple) -> str:
        t = real[i[0]]
        seq = int(np.searchsorted(bounds, t, side="right")) - 1
        return f"sequence {seq} (initial state {init[seq]}), row {t - bounds[seq]}, channel {i[1]}"

    ctx.compare(out.index_select(0, rows) if isinstance(out, torch.Tensor) else out, ref.index_select(0, rows),
                "causal_conv1d_fn output", where=where)
    ctx.compare(states, ref_states, "conv state after causal_conv1d_fn",
                where=lambda i: f"slot {i[0]}, channel {i[1]}, history {i[2]}")


def check_causal_conv1d_update(ctx: CaseContext) -> None:
    """``causal_conv1d_update``: one token per sequence (and a padding row) continuing its slot, against the
    reference: outputs and the shifted states."""
    p = ctx.params
    dim, width = p["dim"], p["width"]
    states, ref_states = _states(ctx, dim, width)
    weight, bias = _weights(ctx, dim, width)
    slots = [3, -1, 0, 6, 1]
    x = ctx.randn(len(slots), dim)
    idx = torch.tensor(slots, dtype=torch.int32, device=ctx.device)
    out = ctx.backend.causal_conv1d_update(x, states, weight, bias, p["activation"], idx)
    ref = conv_ops.causal_conv1d_update(x, ref_states, weight, bias, p["activation"], idx)
    real = torch.tensor([i for i, s in enumerate(slots) if s >= 0], dtype=torch.long, device=ctx.device)
    ctx.compare(out.index_select(0, real) if isinstance(out, torch.Tensor) else out, ref.index_select(0, real),
                "causal_conv1d_update output")
    ctx.compare(states, ref_states, "conv state after causal_conv1d_update",
                where=lambda i: f"slot {i[0]}, channel {i[1]}, history {i[2]}")


@lru_cache(maxsize=None)
def tiny_lfm2(head_size: int, seed: int = 0, max_positions: int = 256) -> str:
    """A seeded random 4-layer LFM2 (conv, attention, conv, attention; kernel 3, conv biases, 4 heads of
    ``head_size`` over 2 KV heads) saved once per process."""
    from transformers import AutoModelForCausalLM, Lfm2Config  # heavy: transformers

    config = Lfm2Config(vocab_size=128, hidden_size=4 * head_size, intermediate_size=6 * head_size, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                        initializer_range=0.15, conv_L_cache=3, conv_bias=True, block_multiple_of=32,
                        layer_types=["conv", "full_attention", "conv", "full_attention"], bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tempfile.mkdtemp(prefix="pagedllm-conformance-lfm2-")
    atexit.register(shutil.rmtree, path, True)
    model.save_pretrained(path)
    return path


def check_state_carry_e2e(ctx: CaseContext) -> None:
    """A tiny LFM2 through ``pagedllm.LLM`` on the backend, prompts over several blocks cut into chunks by a small
    token budget (so every conv layer continues its state across chunks, then decodes): top-k logprobs of every
    position against core's reference backend, greedy tokens against HF."""
    try:
        import pagedllm.entrypoints.llm  # noqa: F401  heavy: the engine stack, not at CLI start
    except ImportError as e:
        raise Untested(f"pagedllm.LLM is not importable yet: {e}") from e
    bs, budget = ctx.params["block_size"], ctx.params["budget"]
    path = tiny_lfm2(ctx.params["head_size"], max_positions=e2e_max_len(bs))
    prompts = e2e_prompts(ctx, bs)
    try:
        got = generate(ctx.backend, path, prompts, bs, max_num_batched_tokens=budget)
    except Exception as e:
        if "recurrent state" in str(e):  # refused at start-up with its reason (e.g. a backend's own model runner)
            raise NotApplicable(f"the backend refuses models with recurrent state: {e}") from e
        raise
    ref = generate(reference_backend(bs), path, prompts, bs, max_num_batched_tokens=budget)
    tol = max(1e-3, ctx.atol)
    for i, ((g_tok, g_plp, g_lp, _), (r_tok, r_plp, r_lp, _)) in enumerate(zip(got, ref)):
        n = next((k for k, (a, b) in enumerate(zip(g_tok, r_tok)) if a != b), len(r_tok))
        for what, pairs in (("prompt", zip(g_plp, r_plp)), ("generated", zip(g_lp[:n + 1], r_lp[:n + 1]))):
            for pos, (a, b) in enumerate(pairs):
                bad = logprob_mismatch(a, b, tol)
                if bad:
                    raise CheckFailed(f"sequence {i} (prompt {len(prompts[i])} tokens, token budget {budget}): "
                                      f"{what} logprobs at index {pos} against core's reference backend: {bad}")
    want = hf_greedy(path, prompts)
    for i, ((g_tok, *_), w) in enumerate(zip(got, want)):
        if g_tok != w:
            raise CheckFailed(first_mismatch(g_tok, w, len(prompts[i]), bs, i) + f" (token budget {budget})")
    ctx.notes.append(f"block size {bs}, token budget {budget}, prompt lengths {[len(p) for p in prompts]}; top-{TOP_K} "
                     "logprobs within tolerance of core's reference backend, greedy tokens equal to HF's")
