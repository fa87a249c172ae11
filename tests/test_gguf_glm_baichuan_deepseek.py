"""GGUF for GLM-4 and Baichuan: archs transformers' GGUF config mapping does not know, so the config is built from
the file's metadata by ``gguf_archs`` and the tensors read through gguf-py's name map. Tiny checkpoints laid out as
llama.cpp's converter writes them (``gguf_utils.write_hf_as_gguf``) load natively and match HF on the same weights.

GLM-4 (arch ``glm4``): partial rotary from ``glm4.rope.dimension_count`` (0.75 of the head here), interleaved rotary
pairs (GGML "norm" rope: rows not permuted), qkv bias, fused ``gate_up_proj`` as ``ffn_up``, post-attention/post-MLP
norms. Baichuan (arch ``baichuan``): llama.cpp splits ``W_pack`` into q/k/v and permutes q/k as for Llama, so the
oracle is HF Llama on the same weights (as tests/test_remote_layouts.py does for the safetensors layout); not 40
layers, so the 7B (rotary) layout. F32 files: logits within 1e-4 of HF on the original checkpoint; Q8_0 files: of HF on
the dequantized weights (a ``gguf.quants`` round trip, independent of our reader)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_utils import assert_engine_greedy_matches_hf, gguf_with_oracle, hf_eager, write_hf_as_gguf
from pagedllm import LLM
from pagedllm.models import load_config, load_model
from test_models import CHUNKED, FULL_PREFILL, _prompts, assert_logits_match, run_schedule
from tiny_models import make_fallback_model, make_tiny_model

#: GLM-4 with rows that split into Q8_0 blocks (hidden 256, 8 heads of 32, 24 of them rotary).
GLM4_GGUF = dict(hidden_size=256, num_attention_heads=8, head_dim=32, intermediate_size=384, vocab_size=512)
#: family -> (GGUF architecture, HF model_type of the config the file loads with, HF architecture)
ARCH = {"glm4": ("glm4", "glm4", "Glm4ForCausalLM"), "baichuan": ("baichuan", "llama", "LlamaForCausalLM")}


def write_family_gguf(family: str, out_dir: str, qtype: str) -> tuple[str, str]:
    """(GGUF path, HF folder with the weights the GGUF holds)."""
    hf_dir = os.path.join(out_dir, "hf")
    if family == "glm4":
        make_fallback_model("glm4", hf_dir, **GLM4_GGUF)
    else:  # Baichuan: multi-head attention (W_pack holds as many k/v heads as q heads)
        make_tiny_model("llama", hf_dir, num_key_value_heads=4)
    return gguf_with_oracle(hf_dir, out_dir, family, ARCH[family][0], qtype)


@pytest.mark.parametrize("family,qtype", [("glm4", "F32"), ("glm4", "Q8_0"), ("baichuan", "F32"),
                                          ("baichuan", "Q8_0")])
def test_gguf_logits_match_hf(tmp_path, ref_backend, family, qtype):
    path, oracle = write_family_gguf(family, str(tmp_path), qtype)
    hf = hf_eager(oracle)
    config = load_config(path)
    assert (config.model_type, config.architectures) == (ARCH[family][1], [ARCH[family][2]])
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "rope_parameters"):
        want = getattr(hf.config, key)  # the file stores floats as float32
        assert getattr(config, key) == (pytest.approx(want, rel=1e-6) if isinstance(want, float) else want), key
    if family == "glm4":
        assert config.attention_bias and config.rope_parameters["partial_rotary_factor"] == 0.75
    else:
        assert not getattr(config, "pagedllm_alibi")
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    prompts = _prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(f"{family} {qtype} gguf", run_schedule(ours, ref_backend, prompts, schedule),
                                expected)


@pytest.mark.parametrize("family", ["glm4", "baichuan"])
def test_gguf_engine_greedy_matches_hf(tmp_path, family):
    """Through the engine: chunked prefill (16-token budget), prefix caching, a mixed batch of 8 (lengths 1-37)."""
    path, oracle = write_family_gguf(family, str(tmp_path), "Q8_0")
    assert_engine_greedy_matches_hf(path, oracle)


def test_baichuan_13b_gguf_runs_alibi(tmp_path, ref_backend, monkeypatch):
    """40 layers is Baichuan-13B to llama.cpp: ALiBi, no rotary. Oracle: HF Llama on the same weights with rotary
    removed and the torch-ops ALiBi attention of tests/test_remote_layouts.py."""
    from transformers import AttentionInterface

    from pagedllm.models.alibi import uses_alibi
    from test_remote_layouts import _alibi_reference_attention

    hf_dir = make_tiny_model("llama", str(tmp_path / "hf"), num_key_value_heads=4, num_hidden_layers=40,
                             hidden_size=128, intermediate_size=128)
    path = write_hf_as_gguf(hf_dir, str(tmp_path / "tiny-baichuan13b.gguf"), "baichuan")
    config = load_config(path)
    assert uses_alibi(config) and config.num_hidden_layers == 40
    AttentionInterface.register("alibi_reference", _alibi_reference_attention)
    monkeypatch.setattr("transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
                        lambda q, k, cos, sin, *a, **kw: (q, k))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="alibi_reference")
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert ours.layers[0].self_attn.alibi
    prompts = _prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf.eval()(torch.tensor([p])).logits[0] for p in prompts]
        # one prefill step: 40 layers of the reference ALiBi attention per decode step are slow (chunked ALiBi is
        # covered by tests/test_remote_layouts.py on the same model code)
        assert_logits_match("baichuan13b gguf", run_schedule(ours, ref_backend, prompts, FULL_PREFILL), expected)


def test_glm4_gguf_tokenizer_is_refused_clearly(tmp_path):
    """transformers cannot read a glm4 GGUF's tokenizer: the engine says so, naming the arch and the way out."""
    from pagedllm.errors import UnsupportedModelError

    path, _ = write_family_gguf("glm4", str(tmp_path), "F32")
    with pytest.raises(UnsupportedModelError, match="'glm4'.*skip_tokenizer_init"):
        LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
