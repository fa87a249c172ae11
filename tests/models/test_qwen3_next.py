"""Qwen3-Next native vs HF (issue 28): Gated DeltaNet linear-attention layers whose conv and delta-rule states live
in a per-request state slot (contract v3) beside gated full-attention layers (output gate, partial rotary, q/k
norms), a sparse MoE with a shared expert and one dense MLP layer (``mlp_only_layers``). A tiny random config
(linear, full, linear, linear, full; kernel 4, 2 key heads for 4 value heads, 4 experts top-2, vocab 500): fp32
logits within 1e-4 of HF through the paged cache and the state slots (full prefill and chunked schedules, reference
and CPU backends); greedy parity through the engine with chunked prefill under a small token budget and mixed
prefill/decode batches, under preemption in a tiny KV pool; n=2 with a seed equal to two single runs; an abort
mid-prefill gives the slot and blocks back; the transformers fallback refuses it at start-up with the reason (the
static-shape backend runs it: tests/plugins/cpu/test_static_state.py)."""

from __future__ import annotations

import pytest
import torch

from engine_parity import assert_preemption_parity, hf_greedy, mixed_prompts
from logit_parity import assert_schedules_match_hf, hf_eager, parity_prompts
from pagedllm.backend import delta_rule_ops
from pagedllm.backend.registry import get_backend
from pagedllm.errors import UnsupportedModelError
from pagedllm.models import load_model
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.models.qwen3_next import Qwen3NextCausalLM
from stateful import QWEN3_NEXT as CONFIG, QWEN3_NEXT_VOCAB as VOCAB
from stateful import (assert_abort_mid_prefill_releases, assert_dropped_state_changes_logits, assert_greedy_matches,
                      assert_n2_seeded_equals_single_runs, assert_released, random_prompts, stateful_engine)
from tiny_models import save_random_model


# Qwen3.5 text: the same layers, the linear attention's projections split (in_proj_qkv / _z / _b / _a); the dense
# form has no experts, the MoE form no mlp_only_layers field.
_MOE_FIELDS = ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok")
QWEN3_5 = {"qwen3_5_text": {k: v for k, v in CONFIG.items() if k not in ("mlp_only_layers", *_MOE_FIELDS)},
           "qwen3_5_moe_text": {k: v for k, v in CONFIG.items() if k != "mlp_only_layers"}}


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory) -> str:
    return save_random_model(CONFIG, tmp_path_factory.mktemp("qwen3_next"))


@pytest.fixture(scope="module", params=sorted(QWEN3_5))
def qwen3_5_dir(request, tmp_path_factory) -> str:
    return save_random_model({**QWEN3_5[request.param], "model_type": request.param},
                             tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("backend_name", ["ref", "cpu"])
def test_qwen3_next_logits_match_hf(qwen3_next_dir, ref_backend, backend_name):
    backend = ref_backend if backend_name == "ref" else get_backend("cpu")
    hf = hf_eager(qwen3_next_dir)
    ours = load_model(qwen3_next_dir, backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, Qwen3NextCausalLM) and (ours.num_layers, ours.num_state_layers) == (2, 3)
    assert ours.state_shapes == ((2 * 16 + 48, 3), (4, 8, 12))
    assert ours.state_dtypes == (torch.float32, torch.float32)
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.layers] == [True, True, False, True, True]
    # 20 and 17 tokens: several blocks of 4, chunks shorter than the kernel
    assert_schedules_match_hf("qwen3_next", hf, ours, backend, parity_prompts(VOCAB))


def test_qwen3_5_text_logits_match_hf(qwen3_5_dir):
    """Qwen3.5 text, dense and MoE: the split projections read by name, logits as HF's through the state slots."""
    backend = get_backend("cpu")
    hf = hf_eager(qwen3_5_dir)
    ours = load_model(qwen3_5_dir, backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, Qwen3NextCausalLM) and ours.layers[0].linear_attn.split_layout
    moe = "moe" in hf.config.model_type
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.layers] == [moe] * 5
    assert_schedules_match_hf(hf.config.model_type, hf, ours, backend, parity_prompts(VOCAB))
    with pytest.raises(UnsupportedModelError, match="does not route attention through AttentionInterface"):
        load_model(qwen3_5_dir, backend=backend, dtype=torch.float32, device=torch.device("cpu"),
                   model_impl="transformers")


def _forgets_state(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    """Every prefill chunk starts from zeros (a plausible bug: the kernel never reads the initial state)."""
    return delta_rule_ops.chunk_gated_delta_rule(q, k, v, g, beta, None, cu_seqlens, scale, use_qk_l2norm_in_kernel)


def test_qwen3_next_delta_rule_state_matters(qwen3_next_dir, ref_backend):
    """The oracle would notice a dropped delta-rule state between chunks: the first chunk is unchanged, later
    chunks differ (the conv state alone does not carry the sequence)."""
    assert_dropped_state_changes_logits(qwen3_next_dir, ref_backend, parity_prompts(VOCAB), "qwen3-next-forgetful",
                                        chunk_gated_delta_rule=_forgets_state)


def test_qwen3_next_greedy_parity_chunked_mixed_batches(qwen3_next_dir):
    """8 prompts of 1..37 tokens (up to 5 blocks of 8) under a 16-token budget: long prompts are cut into chunks
    that continue their conv and delta-rule states while other sequences decode in the same steps; 16 greedy tokens
    each equal HF's. Prefix caching is off for the stateful model."""
    llm = stateful_engine(qwen3_next_dir, enable_prefix_caching=True)
    assert isinstance(llm.llm_engine.model, Qwen3NextCausalLM)
    assert not llm.llm_engine.kv.enable_caching and llm.llm_engine.scheduler.swap is None
    steps: list[tuple[int, int, bool]] = []  # (decodes, sequences, a chunk continuing its state) per forward
    llm.llm_engine.model.register_forward_pre_hook(lambda _m, args: steps.append(
        (args[2].num_decodes, args[2].num_seqs, args[2].has_initial_state is not None
         and bool(args[2].has_initial_state[args[2].num_decodes:].any()))))
    prompts = random_prompts(VOCAB, (1, 2, 7, 9, 16, 17, 23, 37))
    assert_greedy_matches(llm, prompts, 16, lambda p, n: hf_greedy(qwen3_next_dir, p, n))
    assert any(0 < nd < n for nd, n, _ in steps), "no step mixed prefill and decode rows"
    assert any(cont for *_, cont in steps), "no prefill chunk continued a state"
    assert_released(llm)


def test_qwen3_next_greedy_parity_under_preemption(qwen3_next_dir):
    """10 blocks of 16 for 7 sequences of up to ~40 + 24 tokens: preempted (recompute: the slot is given back and
    the states rebuilt from scratch), still HF's tokens; nothing left held."""
    assert_released(assert_preemption_parity(qwen3_next_dir, VOCAB, max_len=40))


def test_qwen3_next_n2_with_seed_equals_two_single_runs(qwen3_next_dir):
    prompt = mixed_prompts(1, VOCAB, seed=3, max_len=30)[0] + [5] * 20
    assert_n2_seeded_equals_single_runs(stateful_engine(qwen3_next_dir), prompt, 12)


def test_qwen3_next_abort_mid_prefill_returns_slot_and_blocks(qwen3_next_dir):
    assert_abort_mid_prefill_releases(stateful_engine(qwen3_next_dir, max_num_batched_tokens=8))


def test_qwen3_next_refused_by_the_fallback(qwen3_next_dir):
    with pytest.raises(UnsupportedModelError, match=r"Qwen3NextForCausalLM does not route attention "
                                                    r"through AttentionInterface"):
        load_model(qwen3_next_dir, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"),
                   model_impl="transformers")
