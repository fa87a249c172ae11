"""The pooling runner's records and rules without a model: PoolingParams / PoolerConfig validation, per-task
defaults (vLLM's), sentence-transformers config reading, the poolers' chunk invariance, and the scheduler's
no-KV path for encoder-only models."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pagedllm.config import EngineConfig
from pagedllm.errors import ParamError, UnsupportedModelError
from pagedllm.outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput,
                              PoolingRequestOutput, ScoringRequestOutput)
from pagedllm.pooling import (Pooler, PoolerConfig, PoolingState, activation, check_request,
                              read_sentence_transformers_config, resolve_pooling, runner_type)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.sched.request import Request
from pagedllm.sched.scheduler import Scheduler


@pytest.mark.parametrize("kwargs,field", [(dict(task="bogus"), "task"), (dict(dimensions=0), "dimensions"),
                                          (dict(normalize="yes"), "normalize"),
                                          (dict(use_activation=1), "use_activation"),
                                          (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens")])
def test_pooling_params_refuse_bad_fields(kwargs, field):
    with pytest.raises(ParamError) as e:
        PoolingParams(**kwargs)
    assert e.value.field == field


def test_task_defaults_follow_vllm():
    assert PoolingParams().verify("embed").normalize is True
    assert PoolingParams().verify("encode").normalize is False
    assert PoolingParams().verify("classify").use_activation is True
    assert PoolingParams(normalize=False).verify("embed").normalize is False
    with pytest.raises(ParamError, match="embeddings only"):
        PoolingParams(dimensions=4).verify("classify")


def test_pooler_config_parse_and_engine_flags():
    assert PoolerConfig.parse('{"pooling_type": "mean", "normalize": false}') == PoolerConfig("MEAN", False)
    assert PoolerConfig.parse({"activation": False}).use_activation is False  # vLLM's older key
    for bad, field in (('{"pooling_type": "MAX"}', "pooler_config.pooling_type"), ("[1]", "pooler_config"),
                       ('{"nope": 1}', "pooler_config.nope"), ("{bad", "pooler_config")):
        with pytest.raises(ParamError) as e:
            PoolerConfig.parse(bad)
        assert e.value.field == field
    for kwargs, field in ((dict(runner="embed"), "runner"), (dict(convert="score"), "convert"),
                          (dict(runner="generate", convert="embed"), "convert"),
                          (dict(hf_overrides="x"), "hf_overrides")):
        with pytest.raises(ParamError) as e:
            EngineConfig(**kwargs)
        assert e.value.field == field
    assert runner_type("auto", "auto", "Qwen3ForSequenceClassification") == "pooling"
    assert runner_type("auto", "auto", "LlamaModel") == "pooling"
    assert runner_type("auto", "embed", "LlamaForCausalLM") == "pooling"
    assert runner_type("auto", "auto", "LlamaForCausalLM") == "generate"
    assert runner_type("auto", "auto", "GPT2LMHeadModel") == "generate"


def test_cli_flags_reach_the_config():
    import argparse

    from pagedllm.commands.engine_args import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p, model_positional=True)
    args = p.parse_args(["m", "--runner", "pooling", "--convert", "embed", "--pooler-config",
                         '{"pooling_type": "CLS"}', "--hf-overrides", '{"is_original_qwen3_reranker": true}'])
    c = engine_config(args)
    assert (c.runner, c.convert, c.pooler_config.pooling_type) == ("pooling", "embed", "CLS")
    assert c.hf_overrides == {"is_original_qwen3_reranker": True}
    with pytest.raises(SystemExit):
        p.parse_args(["m", "--hf-overrides", "[1]"])


def _st_folder(tmp_path, modules, pooling=None):
    tmp_path.mkdir()
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    if pooling is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return str(tmp_path)


def test_sentence_transformers_config(tmp_path):
    assert read_sentence_transformers_config(str(tmp_path)) is None
    tr = {"path": "", "type": "sentence_transformers.models.Transformer"}
    pool = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    norm = {"path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    st = read_sentence_transformers_config(_st_folder(tmp_path / "a", [tr, pool, norm], {
        "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    assert (st.pooling_type, st.normalize) == ("MEAN", True)
    with pytest.raises(UnsupportedModelError, match="max_tokens"):
        read_sentence_transformers_config(_st_folder(tmp_path / "b", [tr, pool], {"pooling_mode_max_tokens": True}))
    with pytest.raises(UnsupportedModelError, match="Dense"):
        read_sentence_transformers_config(_st_folder(tmp_path / "c", [
            tr, pool, {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}], {}))


def _spec(tmp_path, **kwargs):
    config = EngineConfig(runner="pooling", **kwargs)
    return resolve_pooling(config, str(tmp_path), "LlamaForCausalLM", 16, None)


def test_spec_and_request_checks(tmp_path):
    spec = _spec(tmp_path)
    assert (spec.convert, spec.tasks, spec.pooling_type, spec.normalize) == ("embed", ("embed", "encode"), "LAST",
                                                                             True)
    p = check_request(spec, PoolingParams(), "m")
    assert (p.task, p.normalize, p.dimensions) == ("embed", True, None)
    with pytest.raises(ParamError, match="hidden size 16") as e:
        check_request(spec, PoolingParams(dimensions=17), "m")
    assert e.value.field == "dimensions"
    with pytest.raises(ParamError) as e:
        check_request(spec, PoolingParams(task="reward"), "m")
    assert e.value.field == "task"
    with pytest.raises(ParamError) as e:
        _spec(tmp_path, convert="classify")
    assert e.value.field == "convert"
    with pytest.raises(ParamError) as e:
        _spec(tmp_path, pooler_config={"pooling_type": "ALL"})
    assert e.value.field == "pooler_config.pooling_type"
    cls = resolve_pooling(EngineConfig(runner="pooling"), str(tmp_path), "X", 16, 1)
    assert cls.tasks == ("classify", "score", "reward", "encode")
    assert check_request(cls, PoolingParams(task="score"), "m").use_activation is True


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS", "ALL"])
def test_pooling_state_is_chunk_invariant(pooling_type):
    h = torch.randn(11, 6, generator=torch.Generator().manual_seed(0))
    whole, chunked = PoolingState(pooling_type), PoolingState(pooling_type)
    whole.add(h, 0, 11)
    for start, stop in ((0, 4), (4, 5), (5, 11)):
        chunked.add(h[start:stop], start, 11)
    ref = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0], "ALL": h}[pooling_type]
    torch.testing.assert_close(whole.pooled(), ref)
    torch.testing.assert_close(chunked.pooled(), ref)


def test_heads(tmp_path):
    spec = _spec(tmp_path)
    h = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))
    state = PoolingState("LAST")
    state.add(h, 0, 5)
    out = Pooler(spec, None, torch.float32).finish(state, check_request(spec, PoolingParams(dimensions=4), "m"))
    torch.testing.assert_close(out, F.normalize(h[-1, :4], dim=-1))  # truncate, then renormalize
    torch.testing.assert_close(activation(torch.tensor([[0.3]])), torch.tensor([[0.3]]).sigmoid())
    torch.testing.assert_close(activation(torch.tensor([[0.3, 1.0]])), torch.tensor([[0.3, 1.0]]).softmax(-1))


def test_output_views():
    base = PoolingRequestOutput("r", PoolingOutput(torch.tensor([0.25, 0.75])), [1, 2], 0, True)
    assert EmbeddingRequestOutput.from_base(base).outputs.embedding == [0.25, 0.75]
    assert ClassificationRequestOutput.from_base(base).outputs.probs == [0.25, 0.75]
    one = PoolingRequestOutput("r", PoolingOutput(torch.tensor([0.5])), [1, 2], 0, True)
    assert ScoringRequestOutput.from_base(one).outputs.score == 0.5
    with pytest.raises(ValueError, match="one number"):
        ScoringRequestOutput.from_base(base)


def test_scheduler_without_kv_cache_runs_whole_prompts():
    """Encoder-only models: a prompt runs whole in one step or waits; no block is ever taken."""
    kv = KVCacheManager(1, 16)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=8, max_model_len=64, requires_kv_cache=False)
    reqs = [Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=1)) for i, n in enumerate((5, 6, 2))]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("r0", 5, True)]
    assert kv.num_used_blocks == 0
    sched.update(out)
    sched.finish(reqs[0], reqs[0].status.FINISHED_STOPPED)
    out = sched.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("r1", 6), ("r2", 2)]
    assert kv.num_used_blocks == 0
