"""Tiny random configs of the native models with recurrent state (issue 28), shared by their model tests
(tests/models/test_lfm2.py, test_qwen3_next.py, test_mamba2.py) and the static-shape backend's state tests
(tests/plugins/cpu/test_static_state.py), and those tests' engine and oracle checks (the teacher-forced schedules
with state slots are ``logit_parity.run_schedule``'s)."""

from __future__ import annotations

from typing import Callable

import torch

from logit_parity import CHUNKED, run_schedule
from pagedllm import LLM, SamplingParams
from pagedllm.backend.registry import Backend
from pagedllm.models import load_model
from plugin_factory import make_plugin

# LFM2: conv, attention, conv, conv, attention; kernel 3, conv biases, GQA 3:1
LFM2_VOCAB = 500
LFM2 = dict(model_type="lfm2", vocab_size=LFM2_VOCAB, hidden_size=96, intermediate_size=144, num_hidden_layers=5,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.15,
            norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, conv_L_cache=3, conv_bias=True,
            block_multiple_of=32, layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
            tie_word_embeddings=True)

# Qwen3-Next: Gated DeltaNet (conv kernel 4) and gated attention layers, MoE + shared expert (one dense MLP layer)
QWEN3_NEXT_VOCAB = 500
QWEN3_NEXT = dict(model_type="qwen3_next", vocab_size=QWEN3_NEXT_VOCAB, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
                  linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_experts=4, num_experts_per_tok=2, mlp_only_layers=[2], max_position_embeddings=256,
                  initializer_range=0.05, rms_norm_eps=1e-6,
                  layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention"],
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)

# Pure Mamba2: 3 layers of 8 heads, 2 groups, SSD chunks of 8 (so prefill chunks cross SSD chunks)
MAMBA2_VOCAB = 300
MAMBA2 = dict(vocab_size=MAMBA2_VOCAB, hidden_size=64, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, model_type="mamba2", num_hidden_layers=3, num_heads=8, head_dim=16, expand=2,
              n_groups=2, state_size=16, conv_kernel=4, chunk_size=8, use_bias=True, use_conv_bias=True,
              tie_word_embeddings=False)


def stateful_engine(path: str, **kw) -> LLM:
    """A CPU engine with chunked prefill under a 16-token budget (blocks of 8, 8 MiB of KV), ``kw`` overriding."""
    return LLM(path, **{**dict(device="cpu", dtype="float32", max_model_len=128, block_size=8,
                               max_num_batched_tokens=16, kv_cache_memory=8 << 20), **kw})


def assert_released(llm: LLM) -> None:
    """Nothing left held: no KV block, no request, every state slot free."""
    eng = llm.llm_engine
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests(), "KV blocks leaked"
    slots = eng.kv.state_slots
    assert slots.num_free == slots.num_slots and not slots.owner, "state slots leaked"


def random_prompts(vocab: int, lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_greedy_matches(llm: LLM, prompts: list[list[int]], n: int, oracle: Callable[[list[int], int], list[int]],
                          label: str = "") -> None:
    """``n`` greedy tokens of each prompt, in one batch, equal the oracle's (HF's) for it alone."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == oracle(p, n), f"{label}prompt of {len(p)} tokens"


def assert_n2_seeded_equals_single_runs(llm: LLM, prompt: list[int], max_tokens: int) -> None:
    """n=2 samples share the prompt but not the state slot (no prefix sharing for stateful models): sample i runs
    with seed + i, exactly as a single request with that seed."""
    prompt = {"prompt_token_ids": prompt}
    kw = dict(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    pair = llm.generate([prompt], SamplingParams(n=2, seed=11, **kw), use_tqdm=False)[0].outputs
    single = [llm.generate([prompt], SamplingParams(seed=s, **kw), use_tqdm=False)[0].outputs[0] for s in (11, 12)]
    assert [list(c.token_ids) for c in pair] == [list(c.token_ids) for c in single]
    assert pair[0].token_ids != pair[1].token_ids
    assert_released(llm)


def assert_abort_mid_prefill_releases(llm: LLM) -> None:
    """A 60-token prompt aborted after two 8-token steps gives its state slot and blocks back; the other request
    finishes and nothing is left held."""
    eng = llm.llm_engine
    eng.add_request("long", {"prompt_token_ids": list(range(3, 63))}, SamplingParams(max_tokens=4))
    eng.add_request("short", {"prompt_token_ids": [7, 8, 9]}, SamplingParams(max_tokens=4, temperature=0))
    eng.step()
    eng.step()
    assert eng.kv.state_slots.has_slot("long") and eng.kv.num_blocks_of("long") > 0
    eng.abort_request("long")
    assert not eng.kv.state_slots.has_slot("long") and eng.kv.num_blocks_of("long") == 0
    while eng.has_unfinished_requests():
        eng.step()
    assert_released(llm)


def assert_dropped_state_changes_logits(path: str, ref_backend, prompts: list[list[int]], name: str,
                                        **forgetful_hooks) -> None:
    """The oracle would notice a dropped state: with ``forgetful_hooks`` (a state op that starts every chunk from
    zeros) the first chunk is the same, later chunks lose the previous chunks' state."""
    cpu = torch.device("cpu")
    good = run_schedule(load_model(path, backend=ref_backend, dtype=torch.float32, device=cpu), ref_backend, prompts,
                        CHUNKED)
    forgetful = Backend(make_plugin(name, **forgetful_hooks), name)
    bad = run_schedule(load_model(path, backend=forgetful, dtype=torch.float32, device=cpu), forgetful, prompts,
                       CHUNKED)
    assert (good[0][:7] - bad[0][:7]).abs().max() < 1e-5  # the first chunk is the same
    assert (good[0][7:] - bad[0][7:]).abs().max() > 1e-2  # later chunks lose the previous chunks' state
