"""GGUF for Mistral, Qwen2, Qwen3, Qwen2-MoE and Mixtral: tiny checkpoints laid out as llama.cpp's converter writes
them (``gguf_utils.write_hf_as_gguf``) load natively and match HF on the same weights.

Mixtral: llama.cpp writes it as arch "llama" with stacked experts; transformers derives a dense Llama config from it,
which ``gguf_moe.complete_moe_config`` turns into Mixtral's (experts from the tensor shapes, top-k from
``llama.expert_used_count``). Mistral: arch "llama" too (q/k rows permuted); transformers reads such a file as Mistral
when ``general.name`` is "mistral" (else as Llama: the same network), but its tensor loader then fails ("Unknown gguf
model_type: mistral in gguf-py"); ours reads the tensors through gguf's llama name map. Its GGUF keys carry no sliding
window, so the tiny model has none (transformers' Mistral default, 4096, is past every prompt here). Qwen2-MoE:
experts stacked (``ffn_{gate,up,down}_exps``), shared expert ``ffn_*_shexp`` and its gate ``ffn_gate_inp_shexp``
(``[hidden]``); llama.cpp's qwen2moe graph makes every layer sparse and never renormalises the top-k, so the tiny
model does neither. F32 files: logits within 1e-4 of HF on the original checkpoint; Q8_0 files (2-D and stacked
weights whose rows split into blocks of 32): of HF on the dequantized weights (a ``gguf.quants`` round trip,
independent of our reader)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_utils import assert_engine_greedy_matches_hf, gguf_with_oracle, hf_eager
from pagedllm.models import load_config, load_model
from pagedllm.models.gguf_config import load_gguf_config
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, parity_prompts, run_schedule
from tiny_models import make_fallback_model, make_tiny_model

#: Qwen2-MoE as llama.cpp can run it: every layer sparse, top-3 of 6 not renormalised, a gated shared expert; rows
#: that split into Q8_0 blocks (hidden 256, 8 heads of 32).
QWEN2_MOE_GGUF = dict(mlp_only_layers=[], norm_topk_prob=False, hidden_size=256, num_attention_heads=8, head_dim=32)
#: Qwen3-MoE as llama.cpp runs it: every layer sparse, top-2 of 6 renormalised (its graph always renormalises, as
#: Qwen3-30B-A3B's config says), no shared expert, q/k norms.
QWEN3_MOE_GGUF = dict(mlp_only_layers=[], norm_topk_prob=True, hidden_size=256, num_attention_heads=8, head_dim=32)
#: Mixtral as llama.cpp writes it (arch "llama"): no sliding window, rope base 10000 (the header writer's).
MIXTRAL_GGUF = dict(sliding_window=None, hidden_size=256, num_attention_heads=8, head_dim=32,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
#: family -> (GGUF architecture, HF model_type of the config the file loads with)
ARCH = {"mistral": ("llama", "mistral"), "qwen2": ("qwen2", "qwen2"), "qwen3": ("qwen3", "qwen3"),
        "qwen2_moe": ("qwen2moe", "qwen2_moe"), "qwen3_moe": ("qwen3moe", "qwen3_moe"), "mixtral": ("llama", "mixtral")}
_MOE_GGUF = {"qwen2_moe": QWEN2_MOE_GGUF, "qwen3_moe": QWEN3_MOE_GGUF, "mixtral": MIXTRAL_GGUF}


def write_family_gguf(family: str, out_dir: str, qtype: str) -> tuple[str, str]:
    """(GGUF path, HF folder with the weights the GGUF holds)."""
    hf_dir = os.path.join(out_dir, "hf")
    if family in _MOE_GGUF:
        make_fallback_model(family, hf_dir, **_MOE_GGUF[family])
    else:
        make_tiny_model(family, hf_dir, **({"sliding_window": None} if family == "mistral" else {}))
    return gguf_with_oracle(hf_dir, out_dir, family, ARCH[family][0], qtype)


@pytest.mark.parametrize("family,qtype", [("mistral", "F32"), ("qwen2", "F32"), ("qwen3", "F32"),
                                          ("qwen2_moe", "F32"), ("mistral", "Q8_0"), ("qwen2", "Q8_0"),
                                          ("qwen3", "Q8_0"), ("qwen2_moe", "Q8_0"), ("mixtral", "F32"),
                                          ("mixtral", "Q8_0"), ("qwen3_moe", "F32"), ("qwen3_moe", "Q8_0")])
def test_gguf_logits_match_hf(tmp_path, ref_backend, family, qtype):
    path, oracle = write_family_gguf(family, str(tmp_path), qtype)
    config = load_config(path)
    assert config.model_type == ARCH[family][1]
    if family == "mixtral":  # transformers alone derives a dense Llama config; the expert tensors complete it
        assert load_gguf_config(path).model_type == "llama"
        assert (config.num_local_experts, config.num_experts_per_tok, config.intermediate_size) == (5, 2, 96)
    hf = hf_eager(oracle)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        if family in ("qwen2", "qwen3"):  # the file's layout, as transformers' own GGUF loader reads it
            hf_gguf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32, attn_implementation="eager").eval()
            for p, e in zip(prompts, expected):
                torch.testing.assert_close(hf_gguf(torch.tensor([p])).logits[0], e, rtol=1e-4, atol=1e-4)
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(f"{family} {qtype} gguf", run_schedule(ours, ref_backend, prompts, schedule),
                                expected)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral", "mistral"])
def test_gguf_engine_greedy_matches_hf(tmp_path, family):
    """Through the engine: chunked prefill (16-token budget), prefix caching, a mixed batch of 8 (lengths 1-37)."""
    path, oracle = write_family_gguf(family, str(tmp_path), "Q8_0")
    assert_engine_greedy_matches_hf(path, oracle)


def test_mixtral_gguf_without_expert_used_count_is_refused(tmp_path, monkeypatch):
    """A llama-arch file with expert tensors but no top-k: refused naming the missing key, not run as top-1."""
    import gguf

    monkeypatch.setattr(gguf.GGUFWriter, "add_expert_used_count", lambda self, n: None)
    path, _ = write_family_gguf("mixtral", str(tmp_path), "F32")
    with pytest.raises(ValueError, match="llama.expert_used_count"):
        load_config(path)
