"""SamplingParams.output_kind: "delta" outputs (what the engine process sends the server) concatenate exactly to the
"cumulative" ones, for n > 1, best_of ranking, logprobs and stop strings; "final_only" yields one output."""

from __future__ import annotations

import pytest
from server_utils import tiny_chat_model

from pagedllm import LLM, ParamError, SamplingParams

PROMPTS = ["Hello, my name is", "The capital of France is"]


@pytest.fixture(scope="module")
def engine():
    return LLM(tiny_chat_model(), device="cpu").llm_engine


def _run(engine, params: SamplingParams) -> dict[str, list]:
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    assert engine.kv.num_used_blocks == 0
    return outs


@pytest.mark.parametrize("kw", [
    dict(temperature=0, max_tokens=16, logprobs=2),
    dict(temperature=0.8, seed=3, n=2, max_tokens=16, logprobs=1),
    dict(temperature=0.8, seed=5, n=1, best_of=3, max_tokens=10),
    dict(temperature=0, max_tokens=24, stop=[" the", "."]),
])
def test_deltas_concatenate_to_cumulative(engine, kw):
    cum = _run(engine, SamplingParams(**kw))
    delta = _run(engine, SamplingParams(output_kind="delta", **kw))
    for rid, outs in cum.items():
        final, deltas = outs[-1], delta[rid]
        assert deltas[-1].finished and sum(d.finished for d in deltas) == 1
        assert deltas[0].prompt_token_ids == final.prompt_token_ids
        assert all(d.prompt_token_ids == [] and d.prompt is None for d in deltas[1:])
        for j, c in enumerate(final.outputs):
            parts = [d.outputs[j] for d in deltas if len(d.outputs) == len(final.outputs)]
            assert "".join(p.text for p in parts) == c.text
            assert [t for p in parts for t in p.token_ids] == c.token_ids
            if c.logprobs is not None:
                assert [lp for p in parts for lp in p.logprobs] == c.logprobs
            assert (parts[-1].finish_reason, parts[-1].stop_reason, parts[-1].index) == (
                c.finish_reason, c.stop_reason, c.index)


def test_final_only_and_bad_kind(engine):
    outs = _run(engine, SamplingParams(temperature=0, max_tokens=8, output_kind="final_only"))
    assert all(len(o) == 1 and o[0].finished for o in outs.values())
    with pytest.raises(ParamError) as e:
        SamplingParams(output_kind="streaming")
    assert e.value.field == "output_kind"


def test_a_shared_large_n_request_samples_as_when_alone(engine):
    """The scheduler's row share (issue 34) changes when a seeded request's samples run, never what they sample."""
    params = SamplingParams(temperature=1.0, seed=11, n=40, max_tokens=8, ignore_eos=True)

    def texts(other: bool) -> tuple[list[str], int]:
        engine.add_request("big", PROMPTS[0], params)
        if other:
            engine.add_request("small", PROMPTS[1], SamplingParams(temperature=0, max_tokens=30))
        steps, final = 0, None
        while engine.has_unfinished_requests():
            steps += 1
            for o in engine.step():
                if o.request_id == "big" and o.finished:
                    final = o
        assert engine.kv.num_used_blocks == 0
        return [c.text for c in final.outputs], steps

    alone, alone_steps = texts(False)
    shared, shared_steps = texts(True)
    assert shared == alone and len(set(alone)) > 1
    assert shared_steps > alone_steps  # the share did hold the 40 samples back while "small" ran
