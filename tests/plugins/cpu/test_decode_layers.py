"""Pure-decode steps of GGUF Llama-family models on one C++ call for all decoder layers (``pagedllm_cpu/
decode_layers.py``, ``csrc/decode_layers.cpp``): the same ops as the eager layers, so an engine on it and one under
``enforce_eager`` return the same tokens and the same log-probabilities bit for bit, on every GGUF block kernel (a
Q4_K_M-style mixed qkv included), at batch 1 and 3; models and steps it does not take run eager."""

from __future__ import annotations

import pytest
import torch

from pagedllm.backend import plain_decoder_layers
from pagedllm_cpu import decode_layers, quant
from int8_act import use_int8_activations

PROMPTS = [[1, 17, 93, 5, 201, 44, 9], [1, 300, 12], [1, 7, 7, 7, 81, 150, 33, 2, 90, 400, 11]]
NEW_TOKENS = 12


def _run(path, prompts, eager: bool):
    """(token ids, each step's top-5 log-probabilities, the graph runner's stats) of a greedy run."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype="float32", quantization="gguf", skip_tokenizer_init=True, max_model_len=128,
              kv_cache_memory=16 << 20, enforce_eager=eager)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = dict(llm.llm_engine.worker.graph_stats or {})
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs] for o in outs]
    llm.shutdown()
    return tokens, logprobs, stats


def _assert_same_as_eager(path) -> None:
    for prompts in (PROMPTS, PROMPTS[:1]):  # decodes of 3 sequences, then of one
        tokens, logprobs, stats = _run(path, prompts, eager=False)
        want_tokens, want_logprobs, _ = _run(path, prompts, eager=True)
        assert stats["decode_layers_steps"] >= NEW_TOKENS - 2  # every step after the prompts' (the first decodes)
        assert tokens == want_tokens
        assert logprobs == want_logprobs  # exact: the same ops on the same tensors


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_block_kernels_decode_as_eager(lib, tmp_path, qtype):
    from gguf_utils import write_tiny_gguf

    _assert_same_as_eager(write_tiny_gguf(tmp_path, qtype))


def test_mixed_type_qkv_decodes_as_eager(lib, tmp_path):
    """llama.cpp's Q4_K_M layout: layer 0's q and k Q4_K beside a Q6_K v (a split linear), a tied Q6_K head."""
    from gguf_utils import write_tied_kquant_gguf

    _assert_same_as_eager(write_tied_kquant_gguf(str(tmp_path / "q4_k_m.gguf"), "Q4_K"))


def test_embedded_smollm2_q4_1_decodes_as_eager(lib):
    _assert_same_as_eager(None)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K_M"])
def test_int8_activations_decode_as_eager(lib, tmp_path, monkeypatch, qtype):
    """With ``PAGEDLLM_CPU_INT8_ACT=1`` decodes of up to ``INT8_ACT_MAX_ROWS`` sequences quantize x to int8 in the
    eager linears (``q8act_gemv``, ``kquant_q8k_gemv``); the plan calls the same kernels for the same calls."""
    from gguf_utils import write_tied_kquant_gguf, write_tiny_gguf

    use_int8_activations(monkeypatch, True)
    assert quant.int8_act_rows() == quant.INT8_ACT_MAX_ROWS >= len(PROMPTS)
    path = (write_tied_kquant_gguf(str(tmp_path / "q4_k_m.gguf"), "Q4_K") if qtype == "Q4_K_M"
            else write_tiny_gguf(tmp_path, qtype))
    _assert_same_as_eager(path)


def test_models_it_does_not_take_run_eager(lib, tmp_path):
    """A dense model (oneDNN-packed linears) and a q/k-norm model are not plain decoders to core and keep the model
    as their runner."""
    from pagedllm import LLM
    from tiny_models import make_tiny_model

    llm = LLM(make_tiny_model("llama", tmp_path / "dense"), device="cpu", dtype="float32", skip_tokenizer_init=True,
              max_model_len=64, kv_cache_memory=8 << 20)
    worker = llm.llm_engine.worker
    why = "a linear other than a QuantizedLinear (dense, tensor-parallel or LoRA-wrapped)"
    assert plain_decoder_layers(worker.model) == (None, why)  # its linears are oneDNN-packed dense kernels
    assert decode_layers.ineligible(worker.model) == why
    assert worker.runner.run is worker.model and "decode_layers_steps" not in worker.graph_stats
    llm.shutdown()

    llm = LLM(make_tiny_model("qwen3", tmp_path / "qk_norm"), device="cpu", dtype="float32",
              skip_tokenizer_init=True, max_model_len=64, kv_cache_memory=8 << 20)
    assert plain_decoder_layers(llm.llm_engine.model) == (
        None, "q/k norms, interleaved rotary, ALiBi, sinks, soft-capping or GeGLU")
    llm.shutdown()

    llm = LLM(None, device="cpu", dtype="float32", quantization="gguf", skip_tokenizer_init=True, max_model_len=64,
              kv_cache_memory=8 << 20)
    model = llm.llm_engine.model
    assert decode_layers.ineligible(model) is None
    plan, rows = decode_layers.build(model)
    assert plan is not None and plan.num_layers() == model.num_layers and rows > 1
    llm.shutdown()


def test_plan_refuses_a_linear_without_parts(lib):
    plan = torch.classes.pagedllm_cpu.DecodeLayers()
    w = torch.ones(8)
    plan.add_layer(w, 1e-6, w, 1e-6, 1, 1, 8, 1.0, 0)
    with pytest.raises(RuntimeError, match="a linear has no part"):
        plan.forward(torch.zeros(1, 8), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                     torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                     [torch.zeros(2, 1, 16, 1, 8)], torch.zeros(16, 8))
    with pytest.raises(RuntimeError, match="kind 7 is not 0-3"):
        plan.add_part(0, 7, w, 0, False, "", -1, -1, 0, None, False)
