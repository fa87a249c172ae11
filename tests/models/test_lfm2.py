"""LFM2 native vs HF (issue 28): short-convolution layers whose conv state lives in a per-request state slot
(contract v3) beside GQA attention layers with q/k norms. A tiny random config (conv, attention, conv, conv,
attention; kernel 3, conv biases, GQA 3:1, vocab 500): fp32 logits within 1e-4 of HF through the paged cache and the
state slots (full prefill and chunked schedules, reference and CPU backends); greedy parity through the engine with
chunked prefill under a small token budget and mixed prefill/decode batches, under preemption in a tiny KV pool;
n=2 with a seed equal to two single runs; an abort mid-prefill gives the slot and blocks back; the transformers
fallback refuses it at start-up with the reason (the static-shape backend runs it:
tests/plugins/cpu/test_static_state.py); and conformance catches a backend whose conv drops the state between
chunks, kernel case and end to end."""

from __future__ import annotations

import pytest
import torch

from engine_parity import assert_preemption_parity, hf_greedy, mixed_prompts
from logit_parity import BLOCK_SIZE, CHUNKED, FULL_PREFILL, assert_logits_match, hf_eager, parity_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.backend import conv_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.hookspec import KVCacheSpec, MambaSpec
from pagedllm.backend.registry import Backend, get_backend
from pagedllm.conformance import run_conformance
from pagedllm.errors import ParamError, UnsupportedModelError
from pagedllm.models import load_model
from pagedllm.models.lfm2 import Lfm2CausalLM
from plugin_factory import make_plugin
from stateful import LFM2 as CONFIG, LFM2_VOCAB as VOCAB
from tiny_models import save_random_model


@pytest.fixture(scope="module")
def lfm2_dir(tmp_path_factory) -> str:
    return save_random_model(CONFIG, tmp_path_factory.mktemp("lfm2"))


def run_stateful_schedule(model: Lfm2CausalLM, backend, prompts: list[list[int]], schedule) -> list[torch.Tensor]:
    """``logit_parity.run_schedule`` with state slots: sequence s owns slot s + 1 (slot 0, like every slot, starts
    as garbage: a fresh chunk must not read it), flagged fresh on its first chunk only."""
    blocks = [-(-len(p) // BLOCK_SIZE) for p in prompts]
    tables = [list(range(1 + sum(blocks[:s]), 1 + sum(blocks[:s + 1]))) for s in range(len(prompts))]
    model.kv_caches = backend.allocate_kv_cache(KVCacheSpec(model.num_layers, sum(blocks) + 1, BLOCK_SIZE,
                                                            model.num_kv_heads, model.head_size, torch.float32,
                                                            torch.device("cpu")))
    spec = MambaSpec(model.num_state_layers, len(prompts) + 1, model.state_shapes, model.state_dtypes,
                     torch.device("cpu"))
    model.state_caches = backend.allocate_state_cache(spec)
    for layer in model.state_caches:
        for t in layer:
            t.normal_()
    done = [0] * len(prompts)
    rows: list[list[torch.Tensor]] = [[] for _ in prompts]
    with torch.inference_mode():
        for step in schedule:
            meta = AttentionMetadata.build([n for _, n in step], [done[s] + n for s, n in step],
                                           [tables[s] for s, _ in step], BLOCK_SIZE)
            meta.state_indices = torch.tensor([s + 1 for s, _ in step], dtype=torch.int32)
            meta.has_initial_state = torch.tensor([done[s] > 0 for s, _ in step])
            tokens = [t for s, n in step for t in prompts[s][done[s]:done[s] + n]]
            positions = [p for s, n in step for p in range(done[s], done[s] + n)]
            logits = model.compute_logits(model(torch.tensor(tokens), torch.tensor(positions), meta))
            for i, (s, n) in enumerate(step):
                rows[s].append(logits[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]])
                done[s] += n
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("backend_name", ["ref", "cpu"])
def test_lfm2_logits_match_hf(lfm2_dir, ref_backend, backend_name):
    backend = ref_backend if backend_name == "ref" else get_backend("cpu")
    hf = hf_eager(lfm2_dir)
    ours = load_model(lfm2_dir, backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, Lfm2CausalLM) and (ours.num_layers, ours.num_state_layers) == (2, 3)
    assert ours.state_shapes == ((96, 2),) and ours.state_dtypes == (torch.float32,)
    prompts = parity_prompts(VOCAB)  # 20 and 17 tokens: several blocks of 4, chunks shorter than the kernel
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
    for schedule in (FULL_PREFILL, CHUNKED):
        assert_logits_match("lfm2", run_stateful_schedule(ours, backend, prompts, schedule), expected)


def test_lfm2_conv_state_matters(lfm2_dir, ref_backend):
    """The oracle would not notice a dropped state if it did nothing: a chunk that starts fresh instead of
    continuing changes the logits."""
    prompts = parity_prompts(VOCAB)
    ours = load_model(lfm2_dir, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    good = run_stateful_schedule(ours, ref_backend, prompts, CHUNKED)
    forgetful = Backend(make_plugin("lfm2-forgetful", causal_conv1d_fn=_forgets_state), "lfm2-forgetful")
    broken = load_model(lfm2_dir, backend=forgetful, dtype=torch.float32, device=torch.device("cpu"))
    bad = run_stateful_schedule(broken, forgetful, prompts, CHUNKED)
    assert (good[0][:7] - bad[0][:7]).abs().max() < 1e-5  # the first chunk is the same
    assert (good[0][7:] - bad[0][7:]).abs().max() > 1e-2  # later chunks lose the previous chunk's inputs


def _engine(path: str, **kw) -> LLM:
    kw = {**dict(device="cpu", dtype="float32", max_model_len=128, block_size=8, max_num_batched_tokens=16,
                 kv_cache_memory=8 << 20), **kw}
    return LLM(path, **kw)


def _assert_released(llm: LLM) -> None:
    eng = llm.llm_engine
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests(), "KV blocks leaked"
    slots = eng.kv.state_slots
    assert slots.num_free == slots.num_slots and not slots.owner, "state slots leaked"


def test_lfm2_greedy_parity_chunked_mixed_batches(lfm2_dir, caplog):
    """8 prompts of 1..37 tokens (up to 5 blocks of 8) under a 16-token budget: long prompts are cut into chunks
    that continue their conv state while other sequences decode in the same steps; 24 greedy tokens each equal
    HF's. Prefix caching is turned off for the stateful model, with one log line saying why."""
    with caplog.at_level("INFO", logger="pagedllm.sched.kv_manager"):
        llm = _engine(lfm2_dir, enable_prefix_caching=True)
    assert isinstance(llm.llm_engine.model, Lfm2CausalLM)
    assert not llm.llm_engine.kv.enable_caching and "prefix caching off" in caplog.text
    assert llm.llm_engine.scheduler.swap is None  # stateful requests are preempted by recompute only
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (1, 2, 7, 9, 16, 17, 23, 37)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert list(o.outputs[0].token_ids) == hf_greedy(lfm2_dir, p, 24), f"prompt of {len(p)} tokens"
    _assert_released(llm)


def test_lfm2_greedy_parity_under_preemption(lfm2_dir):
    """10 blocks of 16 for 7 sequences of up to ~40 + 24 tokens: preempted (recompute: the slot is given back and
    the state rebuilt from scratch), still HF's tokens; nothing left held."""
    _assert_released(assert_preemption_parity(lfm2_dir, VOCAB, max_len=40))


def test_lfm2_n2_with_seed_equals_two_single_runs(lfm2_dir):
    """n=2 samples share the prompt but not the state slot (no prefix sharing for stateful models): sample i runs
    with seed + i, exactly as a single request with that seed."""
    llm = _engine(lfm2_dir)
    prompt = {"prompt_token_ids": mixed_prompts(1, VOCAB, seed=3, max_len=30)[0] + [5] * 20}
    kw = dict(temperature=1.0, max_tokens=16, ignore_eos=True)
    pair = llm.generate([prompt], SamplingParams(n=2, seed=11, **kw), use_tqdm=False)[0].outputs
    single = [llm.generate([prompt], SamplingParams(seed=s, **kw), use_tqdm=False)[0].outputs[0] for s in (11, 12)]
    assert [list(c.token_ids) for c in pair] == [list(c.token_ids) for c in single]
    assert pair[0].token_ids != pair[1].token_ids
    _assert_released(llm)


def test_lfm2_abort_mid_prefill_returns_slot_and_blocks(lfm2_dir):
    llm = _engine(lfm2_dir, max_num_batched_tokens=8)
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
    _assert_released(llm)


def test_lfm2_refused_by_the_fallback_and_speculation(lfm2_dir):
    with pytest.raises(UnsupportedModelError, match="conv"):
        load_model(lfm2_dir, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"),
                   model_impl="transformers")
    with pytest.raises(ParamError, match=r"speculative_config: Lfm2ForCausalLM keeps recurrent state"):
        LLM(lfm2_dir, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})


# ---- conformance: an injected bug in the state carry between chunks -----------------------------------------
def _forgets_state(x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state, activation):
    """Every chunk starts from zeros (a plausible bug: the kernel never reads the initial state)."""
    return conv_ops.causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, state_indices,
                                     torch.zeros_like(has_initial_state), activation)


def test_conformance_fails_a_conv_that_drops_the_state_between_chunks():
    bad = Backend(make_plugin("lfm2-forgetful-conf", causal_conv1d_fn=_forgets_state), "lfm2-forgetful-conf")
    report = run_conformance(bad, allow=["causal_conv1d_fn.*[dim64-w3-identity|float32]", "state_carry_vs_hf"])
    status = {r.kernel: r.status for r in report.results if r.status != "untested"}
    assert status == {"causal_conv1d_fn.fresh": "passing", "causal_conv1d_fn.continue": "failing",
                      "causal_conv1d_fn.mixed": "failing", "state_carry_vs_hf": "failing"}, status
    e2e = next(r for r in report.results if r.kernel == "state_carry_vs_hf")
    assert "token budget 7" in e2e.error
