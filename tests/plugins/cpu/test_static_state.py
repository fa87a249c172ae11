"""Models with recurrent state on ``cpu-static`` (issue 28, item 4): the state slots ride in the static runner's
persistent bucket buffers (``state_indices`` / ``has_initial_state``, padding rows -1), so LFM2, Qwen3-Next and
Mamba2 run with padded bucketed batch shapes. Oracle: HF transformers on tiny random configs — greedy tokens equal
HF's argmax over the same sequence, fp32 log-probabilities of prompt and generated positions within 1e-4 of HF's —
with chunked prefill under a 16-token budget, mixed prefill/decode steps, steps of 3 sequences in a bucket of 4
while the last slot (the one a padding row's -1 would wrap to) is live, both the on-device sampling program and the
forward-only one; an abort mid-prefill gives the slot and blocks back; a capture that cannot take the state ops
runs those steps eagerly over the bucket buffers, with one log line."""

from __future__ import annotations

import pytest
import torch

from engine_parity import hf_model
from pagedllm import LLM, SamplingParams
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.batch_policy import BucketPolicy
from pagedllm.backend.hookspec import KVCacheSpec, MambaSpec, RunnerContext
from pagedllm.backend.registry import get_backend
from pagedllm.backend.static_runner import StaticGraphRunner
from pagedllm.models import load_model
from stateful import LFM2, LFM2_VOCAB, MAMBA2, MAMBA2_VOCAB, QWEN3_NEXT, QWEN3_NEXT_VOCAB
from stateful import assert_abort_mid_prefill_releases, assert_released
from tiny_models import save_random_model

FAMILIES = {"lfm2": (LFM2, LFM2_VOCAB), "qwen3_next": (QWEN3_NEXT, QWEN3_NEXT_VOCAB),
            "mamba2": (MAMBA2, MAMBA2_VOCAB)}
MAX_SEQS = 4  # sequence buckets 1, 2, 4: three running sequences pad to four
TOL = 1e-4


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model_dir(request, tmp_path_factory) -> str:
    cfg, _ = FAMILIES[request.param]
    return save_random_model(cfg, tmp_path_factory.mktemp(request.param))


def _engine(path: str, **kw) -> LLM:
    return LLM(path, **{**dict(device="cpu-static", dtype="float32", max_model_len=96, block_size=8,
                               max_num_batched_tokens=16, max_num_seqs=MAX_SEQS, kv_cache_memory=8 << 20), **kw})


def _record_steps(llm: LLM) -> list[tuple[int, int, bool, bool]]:
    """Per step: (real sequences, bucket sequences, has a prefill chunk, the last slot is live)."""
    runner, steps = llm.llm_engine.worker.runner, []
    last = llm.llm_engine.kv.state_slots.num_slots - 1
    for name in ("run", "sample"):
        fn = getattr(runner, name)

        def recorded(input_ids, positions, meta, *rest, _fn=fn):
            idx = meta.state_indices
            real = int((idx >= 0).sum())
            steps.append((real, int(idx.shape[0]), meta.num_decodes < real, bool((idx == last).any())))
            return _fn(input_ids, positions, meta, *rest)
        setattr(runner, name, recorded)
    return steps


def _hf_logprobs(path: str, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_model(path)(torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_static_state_matches_hf(model_dir, request):
    """7 prompts of 3..41 tokens, 4 to 24 new tokens each, through 4 state slots: long prompts are cut into chunks
    (16-token budget) that continue their state beside decoding sequences, and as requests finish at different
    times steps hold fewer sequences than their bucket while the last slot is in use. Every generated token is
    HF's argmax over the same sequence (greedy parity); rows with logprobs (the forward-only program; the others
    sample inside the bucket's program) and their prompts' logprobs are within 1e-4 of HF's."""
    _, vocab = FAMILIES[request.node.callspec.params["model_dir"]]
    llm = _engine(model_dir)
    eng = llm.llm_engine
    assert eng.worker.graph_stats["carries_state"] and eng.worker.graph_level == "full"
    steps = _record_steps(llm)
    g = torch.Generator().manual_seed(7)
    lens, news = (3, 5, 7, 30, 41, 9, 17), (4, 6, 5, 24, 10, 8, 12)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                             **(dict(logprobs=2, prompt_logprobs=2) if i % 2 else {}))
              for i, n in enumerate(news)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        got = list(o.outputs[0].token_ids)
        assert len(got) == news[i]
        ref = _hf_logprobs(model_dir, p + got)
        want = ref[len(p) - 1:-1].argmax(-1).tolist()
        assert got == want, f"prompt {i} ({len(p)} tokens): greedy tokens differ from HF's argmax"
        if i % 2:
            for pos, lp in enumerate(o.outputs[0].logprobs):
                for tok, v in lp.items():
                    assert abs(v.logprob - float(ref[len(p) - 1 + pos, tok])) < TOL, (i, "generated", pos, tok)
            for pos, lp in enumerate(o.prompt_logprobs[1:], start=1):
                for tok, v in lp.items():
                    assert abs(v.logprob - float(ref[pos - 1, tok])) < TOL, (i, "prompt", pos, tok)
    assert_released(llm)
    # The schedule did cover what the padding rules protect: chunked prefill beside decodes, and padded steps
    # (with a prefill chunk) while the last slot is live.
    assert any(pre and real > 1 for real, _, pre, _ in steps), "no mixed prefill/decode step"
    assert any(real < bucket and pre and last for real, bucket, pre, last in steps), steps
    assert any(real == 3 and bucket == 4 for real, bucket, _, _ in steps), steps
    assert eng.worker.graph_stats["replays"] > 0


def test_abort_mid_prefill_returns_slot_and_blocks(model_dir):
    assert_abort_mid_prefill_releases(_engine(model_dir, max_num_batched_tokens=8))


def test_uncapturable_state_steps_run_eagerly_over_the_bucket_buffers(tmp_path, caplog):
    """A capture other than the identity (here one that refuses to be used) would freeze the state ops' host
    planning: the runner never calls it for a model with state, logs why once, and still runs each bucket from its
    persistent buffers, padded rows (-1) left alone (Qwen3-Next: its prefill writes final delta-rule states back)."""
    path = save_random_model(QWEN3_NEXT, tmp_path / "qwen3_next")
    model = load_model(path, backend=get_backend("cpu"), dtype=torch.float32, device=torch.device("cpu"))
    policy = BucketPolicy(token_buckets=(8,), seq_buckets=(2,), block_buckets=(2,), block_size=8)

    def capture(fn):
        raise AssertionError("the state ops were captured")

    ctx = RunnerContext(None, None, 16, 8, 2, 8, torch.float32, torch.device("cpu"), policy, -1)
    with caplog.at_level("INFO", logger="pagedllm.backend.static_runner"):
        runner = StaticGraphRunner(model, ctx, capture)
    assert "run eagerly over the bucket buffers" in caplog.text and runner.stats["state_steps"] == "eager"
    backend = get_backend("cpu")
    model.kv_caches = backend.allocate_kv_cache(KVCacheSpec(model.num_layers, 4, 8, model.num_kv_heads,
                                                            model.head_size, torch.float32, torch.device("cpu")))
    model.state_caches = backend.allocate_state_cache(MambaSpec(model.num_state_layers, 2, model.state_shapes,
                                                                model.state_dtypes, torch.device("cpu")))
    for layer in model.state_caches:
        for t in layer:
            t.fill_(7.0)
    prompt = [5, 9, 11, 4, 6]
    meta = AttentionMetadata.build([5, 0], [5, 0], [[1, 0], [0, 0]], 8)
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((3,), -1, dtype=torch.int64)])
    meta.state_indices = torch.tensor([0, -1], dtype=torch.int32)
    meta.has_initial_state = torch.tensor([False, False])
    ids = torch.tensor(prompt + [0, 0, 0])
    with torch.inference_mode():
        hidden = runner.run(ids, torch.tensor([0, 1, 2, 3, 4, 0, 0, 0]), meta)
        logits = model.compute_logits(hidden[:5]).float()
    ref = _hf_logprobs(path, prompt)
    assert (torch.log_softmax(logits, -1) - ref).abs().max() < TOL
    for layer in model.state_caches:  # the padding row's slot -1 (= slot 1) is untouched
        for t in layer:
            assert bool((t[1] == 7.0).all())
    assert runner.stats["captures"] == 1 and runner.buckets[(8, 2, 2)].meta.state_indices.tolist() == [0, -1]


def test_fresh_one_token_chunk_is_a_prefill_on_the_dynamic_backend(model_dir, request):
    """The same schedule on ``cpu`` (dynamic shapes): a request whose first chunk is one token, scheduled beside
    decodes into a slot an earlier request used, is a prefill (fresh state), not a decode reading the slot's old
    state — greedy tokens equal HF's argmax."""
    _, vocab = FAMILIES[request.node.callspec.params["model_dir"]]
    llm = _engine(model_dir, device="cpu")
    runner, fresh_one = llm.llm_engine.worker.runner, []
    prepare = runner.prepare

    def recorded(batch):
        out = prepare(batch)
        fresh_one.extend(len(batch) > 1 for s in batch if s.num_computed_tokens == 0 and s.num_new_tokens == 1)
        return out
    runner.prepare = recorded
    g = torch.Generator().manual_seed(7)
    lens, news = (3, 5, 7, 30, 41, 9, 17), (4, 6, 5, 24, 10, 8, 12)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in news], use_tqdm=False)
    assert any(fresh_one), "no fresh one-token chunk beside other sequences"
    for i, (p, o) in enumerate(zip(prompts, outs)):
        got = list(o.outputs[0].token_ids)
        assert got == _hf_logprobs(model_dir, p + got)[len(p) - 1:-1].argmax(-1).tolist(), f"prompt {i}"
    assert_released(llm)
