"""Tensor parallel (2 ranks x 1 thread, gloo, multiprocessing executor) against the same engine on one rank.

The oracle is the one-rank engine (itself checked against HF in test_engine_parity.py): TP=2 must give the same
greedy tokens and every step's float32 logits within the bounds in dist_utils (float32 summation order of the
row-parallel split: TP=2 equals that split done in one process), on a workload that batches decodes with chunked
prefills and hits the prefix cache. The models carry the shapes sharding must handle: a vocabulary two ranks do not divide
(Llama, 509) and one kv head for two ranks (Qwen3: the kv head is replicated).
"""

from __future__ import annotations

import openai
import pytest
import torch

from dist_utils import (TP_LOGITS_ABS, TP_LOGITS_REL, engine, make_dist_model, max_abs_diff, row_split_engine,
                        run_capturing_logits, workload)
from pagedllm import LLM, SamplingParams
from pagedllm.distributed.layers import RowParallelLinear
from pagedllm.errors import ParamError
from server_utils import API_KEY, ServerProcess, tiny_chat_model


@pytest.fixture(scope="module")
def dist_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dist_models")
    return {name: make_dist_model(name, root) for name in ("llama", "qwen3")}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_tp2_tokens_and_logits_match_one_rank(dist_models, name):
    # One thread in this process throughout, as each rank has: oneDNN's summation order depends on the thread count,
    # and the comparisons below are about the split alone.
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _tp2_tokens_and_logits_match_one_rank(dist_models, name)
    finally:
        torch.set_num_threads(saved_threads)


def _tp2_tokens_and_logits_match_one_rank(dist_models, name):
    prompts = workload()
    assert max(map(len, prompts)) > 48  # longer than the token budget: chunked prefill
    ref = engine(dist_models[name])
    want_tokens, want_logits = run_capturing_logits(ref, prompts)
    llm = engine(dist_models[name], tp=2)
    try:
        ex = llm.llm_engine.executor
        assert ex is not None and ex.name == "mp" and len(ex.worker_pids) == 1
        row_parallel = [m for m in llm.llm_engine.model.modules() if isinstance(m, RowParallelLinear)]
        assert len(row_parallel) == 4 and all(m.dense is not None for m in row_parallel)  # the TP=1 dense kernel
        tokens, logits = run_capturing_logits(llm, prompts)
        rank0_threads = torch.get_num_threads()  # what the executor bound this process (rank 0) to
        stats = llm.llm_engine.get_stats()
        assert stats.prefix_hits > 0  # the shared-prefix prompts hit the cache
        assert ex.num_steps == len(logits) >= 10
    finally:
        llm.llm_engine.shutdown()
    assert [p.returncode for p in ex.procs] == [0]  # the worker left cleanly
    # The same row-parallel split in this process (rank 0's thread count): TP=2's logits are that computation's.
    assert rank0_threads == 1
    split_tokens, split_logits = run_capturing_logits(row_split_engine(dist_models[name]), prompts)
    assert tokens == want_tokens == split_tokens
    assert len(logits) == len(want_logits)
    worst = max_abs_diff(logits, want_logits)
    scale = max(b.abs().max().item() for b in want_logits)
    split = max_abs_diff(logits, split_logits)
    print(f"{name}: max |logit TP=2 - TP=1| = {worst:.2e} (logits up to {scale:.1f}, {worst / scale:.1e} of it), "
          f"|TP=2 - one-process row split| = {split:.1e}, over {len(logits)} steps")
    assert split <= 1e-6  # measured 0 (bitwise): sharded columns and the vocab-parallel head add nothing
    assert worst <= TP_LOGITS_ABS and worst <= TP_LOGITS_REL * scale


def test_bad_distributed_settings_are_refused_by_name(dist_models):
    path = dist_models["llama"]
    cases = [(dict(tensor_parallel_size=3), "tensor_parallel_size"),  # 4 heads
             (dict(tensor_parallel_size=0), "tensor_parallel_size"),
             (dict(pipeline_parallel_size=3), "pipeline_parallel_size"),  # 2 layers
             (dict(tensor_parallel_size=2, distributed_executor_backend="mpi"), "distributed_executor_backend"),
             (dict(tensor_parallel_size=2, enable_lora=True), "enable_lora"),
             (dict(tensor_parallel_size=2, enable_expert_parallel=True), "enable_expert_parallel"),  # dense model
             (dict(enable_expert_parallel=True), "enable_expert_parallel")]  # one rank
    for kw, field in cases:
        with pytest.raises(ParamError) as e:
            LLM(path, device="cpu", dtype="float32", max_model_len=64, skip_tokenizer_init=True, **kw)
        assert e.value.field == field, (kw, e.value)


@pytest.mark.slow
def test_serve_tensor_parallel_2_from_the_command_line():
    """``pagedllm serve --tensor-parallel-size 2`` answers with the one-rank engine's greedy text."""
    model = tiny_chat_model()
    llm = LLM(model, device="cpu", dtype="float32", max_model_len=256)
    want = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    srv = ServerProcess(model, "--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "256")
    try:
        client = openai.OpenAI(base_url=srv.url_v1, api_key=API_KEY, max_retries=0)
        r = client.completions.create(model="test-model", prompt="The capital of France is", max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].text == want and r.usage.completion_tokens == 12
        assert "rank1" in srv.output() or "Traceback" not in srv.output()
    finally:
        srv.stop()
    torch.set_num_threads(torch.get_num_threads())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_expert_parallel_matches_one_rank(tmp_path, name):
    """``--enable-expert-parallel``: the tiny Mixtral's 5 experts split 3 + 2 over two ranks (Qwen2-MoE: 6 routed
    experts 3 + 3, its shared expert and dense layer replicated / tensor-parallel); same greedy tokens and logits as
    one rank."""
    import tiny_models

    path = tiny_models.make_fallback_model(name, tmp_path / name)
    prompts = workload(num=6)
    want_tokens, want_logits = run_capturing_logits(engine(path), prompts)
    with pytest.raises(ParamError, match="enable-expert-parallel"):
        engine(path, tp=2)
    llm = engine(path, tp=2, enable_expert_parallel=True)
    try:
        blocks = [layer.mlp for layer in llm.llm_engine.model.layers if hasattr(layer.mlp, "w13")]
        assert blocks and all(b.w13.shape[0] == 3 for b in blocks)  # rank 0's share of the experts
        tokens, logits = run_capturing_logits(llm, prompts)
    finally:
        llm.llm_engine.shutdown()
    assert tokens == want_tokens
    worst = max((a - b).abs().max().item() for a, b in zip(logits, want_logits, strict=True))
    scale = max(b.abs().max().item() for b in want_logits)
    print(f"{name} EP=2: max |logit diff| = {worst:.2e} (logits up to {scale:.1f})")
    assert worst <= 1e-5 * max(1.0, scale)
