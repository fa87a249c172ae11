"""Mamba2 and Granite-4.0-H native vs HF (issue 28): Mamba2 mixers whose conv and SSM states live in per-request
state slots (contract v3, two tensors per layer in one ``MambaSpec``), alone (``Mamba2ForCausalLM``: no attention
layer, an empty paged KV group) and interleaved with GQA attention and MoE (``GraniteMoeHybridForCausalLM``, every
Granite multiplier set away from 1). Tiny random configs with SSD chunks of 8 tokens and 2 B/C groups: fp32 logits
within 1e-4 of HF through the state slots (full prefill and chunked schedules, reference and CPU backends); greedy
parity through the engine with chunked prefill under a small token budget and mixed prefill/decode batches, under
preemption in a tiny KV pool; n=2 with a seed equal to two single runs; an abort mid-prefill gives the slot and
blocks back; the transformers fallback refuses both at start-up with the reason, and the static-shape backend
(``cpu-static``) gives HF's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from engine_parity import hf_model, mixed_prompts, run
from logit_parity import assert_schedules_match_hf, hf_eager, parity_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.backend import ssm_ops
from pagedllm.backend.registry import get_backend
from pagedllm.errors import ParamError, UnsupportedModelError
from pagedllm.models import load_model
from pagedllm.models.granite_hybrid import GraniteMoeHybridCausalLM
from pagedllm.models.mamba2 import Mamba2CausalLM
from stateful import MAMBA2 as STATEFUL_MAMBA2
from stateful import (assert_abort_mid_prefill_releases, assert_dropped_state_changes_logits, assert_greedy_matches,
                      assert_n2_seeded_equals_single_runs, assert_released, random_prompts, stateful_engine)
from tiny_models import save_random_model

VOCAB = 300
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, initializer_range=0.15, bos_token_id=1, eos_token_id=2,
               pad_token_id=0)
MAMBA2 = dict(STATEFUL_MAMBA2)  # no max_position_embeddings: Mamba2 configs name none (models/mamba2.py's default)
GRANITE = dict(_COMMON, model_type="granitemoehybrid", intermediate_size=32, shared_intermediate_size=48,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16,
               mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8,
               num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=3.0, residual_multiplier=0.5,
               attention_multiplier=0.2, logits_scaling=2.5, position_embedding_type="rope",
               max_position_embeddings=256)
FAMILIES = {"mamba2": (MAMBA2, Mamba2CausalLM, 0, 3), "granite": (GRANITE, GraniteMoeHybridCausalLM, 1, 3)}
# Granite-4.0-H-micro's shape: no routed experts (the shared MLP only) and no rotary (NoPE), tied embeddings
GRANITE_DENSE_NOPE = dict(GRANITE, num_local_experts=0, position_embedding_type=None, tie_word_embeddings=True,
                          layer_types=["mamba", "attention", "mamba", "attention"])
LOGIT_FAMILIES = {**FAMILIES, "granite_dense_nope": (GRANITE_DENSE_NOPE, GraniteMoeHybridCausalLM, 2, 2)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("mamba2")
    return {name: save_random_model(cfg, root / name) for name, (cfg, *_rest) in LOGIT_FAMILIES.items()}


def hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    """HF's greedy tokens through its own recurrent cache, passed as ``cache=`` (Mamba2's outputs and forward name
    it so; ``hf_oracle.hf_greedy``'s ``past_key_values`` does not reach Mamba2's state, and its decode steps then
    start from nothing)."""
    model, ids = hf_model(path), []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            ids.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[ids[-1]]]), cache=out.cache if hasattr(out, "cache") else out.past_key_values,
                        use_cache=True)
    return ids


def test_hf_oracle_decodes_through_its_state(dirs):
    """The oracle's cached decode equals recomputing the whole sequence each step (so it carries HF's state)."""
    prompt, model, ids = [5, 6, 7, 8, 9], hf_model(dirs["mamba2"]), []
    with torch.inference_mode():
        for _ in range(6):
            ids.append(int(model(torch.tensor([prompt + ids])).logits[0, -1].argmax()))
    assert hf_greedy(dirs["mamba2"], prompt, 6) == ids


@pytest.mark.parametrize("family", LOGIT_FAMILIES)
@pytest.mark.parametrize("backend_name", ["ref", "cpu"])
def test_logits_match_hf(dirs, ref_backend, family, backend_name):
    backend = ref_backend if backend_name == "ref" else get_backend("cpu")
    _, cls, attention_layers, state_layers = LOGIT_FAMILIES[family]
    hf = hf_eager(dirs[family])
    ours = load_model(dirs[family], backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, cls) and (ours.num_layers, ours.num_state_layers) == (attention_layers, state_layers)
    assert ours.state_shapes == ((128 + 2 * 2 * 16, 3), (8, 16, 16))  # (conv_dim, kernel-1), (heads, p, d_state)
    assert ours.state_dtypes == (torch.float32, torch.float32)
    # 20 and 17 tokens: several blocks of 4 and SSD chunks of 8
    assert_schedules_match_hf(family, hf, ours, backend, parity_prompts(VOCAB))


def _forgets_ssm_state(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states, D, z, dt_bias, dt_softplus,
                       dt_limit):
    """Every prefill chunk starts its SSM from zeros (a plausible bug: the scan never reads the initial states)."""
    return ssm_ops.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, cu_seqlens, None, D, z, dt_bias,
                                             dt_softplus, dt_limit)


def test_ssm_state_carry_matters(dirs, ref_backend):
    """The oracle would notice a dropped SSM state: a chunk that starts fresh instead of continuing changes the
    logits from the second chunk on."""
    assert_dropped_state_changes_logits(dirs["mamba2"], ref_backend, parity_prompts(VOCAB), "mamba2-forgetful",
                                        mamba_chunk_scan_combined=_forgets_ssm_state)


def _engine(path: str, **kw) -> LLM:
    return stateful_engine(path, **{"max_num_seqs": 16, **kw})


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_chunked_mixed_batches(dirs, family, caplog):
    """6 prompts of 1..37 tokens under a 16-token budget: long prompts are cut into chunks that continue their conv
    and SSM states while other sequences decode in the same steps; 16 greedy tokens each equal HF's. Prefix
    caching is turned off for the stateful model, with one log line saying why."""
    with caplog.at_level("INFO", logger="pagedllm.sched.kv_manager"):
        llm = _engine(dirs[family], enable_prefix_caching=True)
    assert isinstance(llm.llm_engine.model, FAMILIES[family][1])
    assert not llm.llm_engine.kv.enable_caching and "prefix caching off" in caplog.text
    prompts = random_prompts(VOCAB, (1, 7, 9, 17, 23, 37))
    assert_greedy_matches(llm, prompts, 16, lambda p, n: hf_greedy(dirs[family], p, n), f"{family}: ")
    assert_released(llm)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_parity_under_preemption(dirs, family):
    """10 blocks of 16 for 7 sequences of up to ~40 + 24 tokens: preempted (recompute: the slot is given back and
    the states rebuilt from scratch), still HF's tokens; nothing left held. Pure Mamba2's blocks cost no memory but
    still bound the batch."""
    llm = LLM(dirs[family], device="cpu", dtype="float32", max_model_len=128, num_gpu_blocks_override=10,
              max_num_seqs=16)
    prompts = mixed_prompts(7, VOCAB, seed=4, max_len=40)
    got = run(llm, prompts, max_tokens=24)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert got == [hf_greedy(dirs[family], p, 24) for p in prompts]
    assert_released(llm)


def test_n2_with_seed_equals_two_single_runs(dirs):
    prompt = mixed_prompts(1, VOCAB, seed=3, max_len=30)[0] + [5] * 20
    assert_n2_seeded_equals_single_runs(_engine(dirs["granite"]), prompt, 12)


@pytest.mark.parametrize("family", FAMILIES)
def test_abort_mid_prefill_returns_slot_and_blocks(dirs, family):
    assert_abort_mid_prefill_releases(_engine(dirs[family], max_num_batched_tokens=8))


def test_state_slots_come_out_of_the_kv_budget(dirs, caplog):
    """Pure Mamba2's KV blocks cost nothing, but its state slots must fit the memory given: 256 slots of ~31 KiB do
    not fit in half of 1 MiB, so max_num_seqs is lowered until they do (logged), and the engine still generates; a
    budget too small for one slot is refused naming the field and the state."""
    with caplog.at_level("WARNING"):
        llm = _engine(dirs["mamba2"], max_num_seqs=256, kv_cache_memory=1 << 20)
    with llm:
        per_slot = llm.llm_engine.worker.state_spec.bytes_per_slot
        slots = llm.llm_engine.kv.state_slots.num_slots
        assert slots == (1 << 19) // per_slot < 256 and llm.llm_engine.worker.max_num_seqs == slots
        assert f"max_num_seqs 256 -> {slots}" in caplog.text
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, SamplingParams(max_tokens=4, temperature=0))
        assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4, 4]
        assert_released(llm)
    with pytest.raises(ParamError, match="kv_cache_memory.*recurrent state of 1 sequences"):
        _engine(dirs["mamba2"], max_num_seqs=256, kv_cache_memory=1 << 10)


@pytest.mark.parametrize("family,arch,why", [
    ("mamba2", "Mamba2ForCausalLM", "does not route attention through AttentionInterface"),
    ("granite", "GraniteMoeHybridForCausalLM", "a recurrent|state")])
def test_refused_by_the_fallback_served_by_static_shapes(dirs, family, arch, why):
    with pytest.raises(UnsupportedModelError, match=f"{arch}.*({why})"):
        load_model(dirs[family], backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"),
                   model_impl="transformers")
    # cpu-static carries the state slots in its bucket buffers (tests/plugins/cpu/test_static_state.py)
    llm = LLM(dirs[family], device="cpu-static", dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=8, kv_cache_memory=16 << 20)
    prompts = mixed_prompts(3, VOCAB, seed=5, max_len=20)
    assert run(llm, prompts, max_tokens=6) == [hf_greedy(dirs[family], p, 6) for p in prompts]


def test_granite_refuses_what_it_would_run_differently(tmp_path):
    from transformers import GraniteMoeHybridConfig

    from pagedllm.models.granite_hybrid import check_granite_hybrid

    base = {k: v for k, v in GRANITE.items() if k != "model_type"}
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        check_granite_hybrid(GraniteMoeHybridConfig(**{**base, "hidden_act": "gelu"}))
    with pytest.raises(UnsupportedModelError, match="rope_type 'linear'"):
        check_granite_hybrid(GraniteMoeHybridConfig(**{**base, "rope_parameters": dict(
            rope_type="linear", factor=2.0, rope_theta=10000.0)}))
