"""GPTQ (v1) and AWQ (GEMM) checkpoints in their exact on-disk formats, written by round-to-nearest from a tiny
model; the oracle is HF transformers running the same model with the hand-dequantized weights (transformers' own
GPTQ/AWQ readers need optimum / gptqmodel, which do not install here)."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_oracle import hf_greedy
from pagedllm import LLM, SamplingParams
from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization import dequantize
from pagedllm.quantization.awq import write_awq
from pagedllm.quantization.gptq import write_gptq
from pagedllm.quantization.grouped import GroupedInt, contiguous_g_idx
from pagedllm.quantization.rtn import quantize_folder
from quant_helpers import PROMPTS, hf_with, logits_pair, make_dense, rel

#: name: (method, quantize_folder kwargs, how cpu runs it). K is 160 or 224: group 32 runs the int4 kernel; groups
#: 64 / 128 leave a short last group, which the kernel cannot take, so its prepare keeps those layers dense (exact);
#: 8-bit GPTQ has no cpu kernel (core's reference). Groups 64 / 128 on the kernel: test_cpu_kernels_conformance.
CASES = {
    "gptq-sym-g32": ("gptq", dict(group_size=32, sym=True), "int4"),
    "gptq-asym-g32-desc_act": ("gptq", dict(group_size=32, sym=False, desc_act=True), "int4"),
    "gptq-sym-g64-desc_act": ("gptq", dict(group_size=64, sym=True, desc_act=True), "dense"),
    "gptq-asym-g128": ("gptq", dict(group_size=128, sym=False), "dense"),
    "gptq-int8-per-channel": ("gptq", dict(bits=8, group_size=-1, sym=False), "reference"),
    "awq-asym-g32": ("awq", dict(group_size=32, sym=False), "int4"),
    "awq-sym-g64": ("awq", dict(group_size=64, sym=True), "dense"),
    "awq-asym-g128": ("awq", dict(group_size=128, sym=False), "dense"),
}


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return make_dense(tmp_path_factory.mktemp("dense"))


def test_packing_matches_the_formats_by_hand():
    """One word each, worked out from AutoGPTQ's / AutoAWQ's packing loops: GPTQ packs 8 values along K lowest
    nibble first and stores zero - 1; AWQ packs along N in the order 0, 2, 4, 6, 1, 3, 5, 7."""
    q = torch.arange(8, dtype=torch.int32).reshape(1, 8)  # values 0..7 in columns 0..7
    awq = write_awq(GroupedInt(q.t().contiguous(), torch.ones(1, 8), torch.full((1, 8), 8.0),
                               contiguous_g_idx(1, -1), 4))  # N=8 rows of K=1: qweight [1, 1]
    assert awq["qweight"].item() == 0x75316420
    assert awq["qzeros"].item() == 0x88888888 - 2 ** 32
    gptq = write_gptq(GroupedInt(q, torch.ones(1, 1), torch.full((1, 1), 8.0), contiguous_g_idx(8, -1), 4))
    assert gptq["qweight"].item() == 0x76543210 and gptq["qweight"].shape == (1, 1)
    assert gptq["qzeros"].item() == 7  # zero 8 stored as 7 (v1)
    # and back: W = (q - z) * s
    w = dequantize(QuantizedWeight("gptq", "int4", gptq, (1, 8)))
    assert torch.equal(w, (q.float() - 8).reshape(1, 8))


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_matches_hand_dequantized_hf(dense_dir, tmp_path, case):
    """Every decoder linear stays packed on the expected kernel; logits equal HF's fake-quantized fp32 model (fp32
    tolerance on the reference; within twice HF-in-bf16's own error where the cpu kernel runs, which also puts the
    LM head in bf16: models/dense_linears.py)."""
    method, kw, how = CASES[case]
    dense = quantize_folder(dense_dir, str(tmp_path / case), method, **kw)
    hf = hf_with(dense_dir, dense)
    got, expected, layers = logits_pair(str(tmp_path / case), method, hf)
    kernel = f"reference({method})" if how == "reference" else "cpu-int4pack"
    assert len(layers) == 8 and {m.kernel_name for m in layers} == {kernel}
    if how != "reference":  # the cpu kernel's state says whether it packed the layer or kept it dense
        assert {m.state[0] for m in layers} == {how}
    if how == "reference":  # exact: core's reference keeps the float32 LM head too
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)
        return
    with torch.inference_mode():
        bf16 = [hf.to(torch.bfloat16)(torch.tensor([p])).logits[0].float() for p in PROMPTS]
    for g, e, b in zip(got, expected, bf16):
        print(f"{case}: relative logit error {rel(g, e):.2e} (HF bf16 {rel(b, e):.2e})")
        assert rel(g, e) <= 2 * rel(b, e) and (g.argmax(-1) == e.argmax(-1)).float().mean() >= 0.8


def test_engine_greedy_parity_and_desc_act_mixed_parts(dense_dir, tmp_path, caplog):
    """Through the engine on the reference (quantization='none' dequantizes at load), greedy equals HF's
    fake-quantized model exactly; q/k/v written with different act-order permutations cannot share one packed
    layout: that layer is dequantized (logged), the rest stay packed."""
    dense = quantize_folder(dense_dir, str(tmp_path / "g"), "gptq", group_size=32, sym=False, desc_act=True)
    hf = hf_with(dense_dir, dense)
    kw = dict(device="cpu", skip_tokenizer_init=True, max_model_len=64, kv_cache_memory=8 << 20)
    llm = LLM(str(tmp_path / "g"), **kw, quantization="none")
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in PROMPTS]
    assert llm.llm_engine.kv.num_used_blocks == 0
    del llm
    from safetensors.torch import load_file, save_file
    path = tmp_path / "g" / "model.safetensors"
    t = load_file(path)
    k_name = "model.layers.0.self_attn.k_proj.g_idx"
    t[k_name] = t[k_name].flip(0).contiguous()  # k's columns grouped differently from q's and v's
    save_file(t, path, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="pagedllm.models.quantized_linears"):
        llm = LLM(str(tmp_path / "g"), **kw)
    assert llm.llm_engine.config.quantization == "gptq"
    assert any("layers.0.self_attn.qkv_proj" in r.getMessage() and "dequantized" in r.getMessage()
               for r in caplog.records)
    from pagedllm.quantization import QuantizedLinear
    assert sum(isinstance(m, QuantizedLinear) for m in llm.llm_engine.model.modules()) == 7


def test_method_backend_pair_and_variant_errors(dense_dir, tmp_path):
    """A backend not declaring gptq: explicit quantization='gptq' is an error naming method and backend, unset runs
    dense; an unsupported variant (GPTQ v2 format, AWQ GEMV) fails before any weight is read, naming it."""
    import json

    from pagedllm.backend.registry import register_backend
    from pagedllm.errors import UnsupportedModelError
    from pagedllm.backend.hookspec import Capabilities
    from pagedllm.quantization import QuantizedLinear
    from pagedllm.errors import ParamError
    from plugin_factory import make_plugin

    qdir = tmp_path / "g"
    quantize_folder(dense_dir, str(qdir), "gptq", group_size=32)
    kw = dict(skip_tokenizer_init=True, max_model_len=64, kv_cache_memory=8 << 20)
    be = register_backend(make_plugin("noquant2", Capabilities(dtypes=("float32",), head_sizes=None)), "noquant2")
    with pytest.raises(ParamError, match="quantization.*backend 'noquant2' does not support 'gptq'"):
        LLM(str(qdir), device=be.name, **kw, quantization="gptq")
    llm = LLM(str(qdir), device=be.name, **kw)
    assert llm.llm_engine.config.quantization is None
    assert not any(isinstance(m, QuantizedLinear) for m in llm.llm_engine.model.modules())
    with pytest.raises(ParamError, match="quantization.*'awq' was requested, but the checkpoint is gptq"):
        LLM(str(qdir), device="cpu", **kw, quantization="awq")
    for method, change, msg in (("gptq", {"checkpoint_format": "gptq_v2"}, "checkpoint_format='gptq_v2'"),
                                ("awq", {"version": "gemv"}, "version='gemv'")):
        cfg_path = qdir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"] = {**cfg["quantization_config"], "quant_method": method, **change}
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(UnsupportedModelError, match=msg):
            LLM(str(qdir), device="cpu", **kw)
