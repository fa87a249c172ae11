"""Remote-code layouts loaded by name mapping, never by running their code: Baichuan-7B is Llama with q/k/v fused
in ``W_pack``. Oracle: the same weights re-laid as a Llama checkpoint, run by HF's Llama. Baichuan-13B (ALiBi, no
rotary): HF has no Baichuan, so the oracle is HF's Llama over the same weights with rotary removed and an ALiBi
attention written from torch ops in this file."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from model_parity import assert_engine_parity
from pagedllm.errors import UnsupportedModelError
from pagedllm.models import load_config, load_model
from pagedllm.models.remote_layouts import BaichuanWeights
from pagedllm.models.weights import DictWeights
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, parity_prompts, run_schedule
from tiny_models import save_random_model

LLAMA = dict(model_type="llama", vocab_size=500, hidden_size=240, intermediate_size=320, num_hidden_layers=2,
             num_attention_heads=5, num_key_value_heads=5, head_dim=48, max_position_embeddings=512,
             initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
             tie_word_embeddings=False)


def baichuan_from_llama(llama_dir: str, out: Path, arch: str = "BaiChuanForCausalLM", extra: dict = None) -> str:
    """Re-lay a Llama checkpoint as Baichuan-7B: q/k/v concatenated into W_pack, Baichuan's config.json."""
    cfg = json.loads((Path(llama_dir) / "config.json").read_text())
    sd = load_file(str(Path(llama_dir) / "model.safetensors"))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        sd[p + "W_pack.weight"] = torch.cat([sd.pop(p + f"{x}_proj.weight") for x in "qkv"])
    sd.update(extra or {})
    out.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(out / "model.safetensors"))
    raw = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                               "eos_token_id", "pad_token_id", "tie_word_embeddings")}
    raw.update(architectures=[arch], model_type="baichuan", hidden_act="silu", torch_dtype="float32",
               auto_map={"AutoConfig": "configuration_baichuan.BaiChuanConfig",
                         "AutoModelForCausalLM": "modeling_baichuan.BaiChuanForCausalLM"})
    (out / "config.json").write_text(json.dumps(raw))
    return str(out)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("baichuan")
    llama = save_random_model(LLAMA, root / "llama")
    return llama, baichuan_from_llama(llama, root / "baichuan")


def test_baichuan_logits_match_llama_oracle(pair, ref_backend):
    llama, baichuan = pair
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(baichuan, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    prompts = parity_prompts(500)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match("baichuan", run_schedule(ours, ref_backend, prompts, schedule), expected)


def test_baichuan_greedy_parity_engine(pair):
    llama, baichuan = pair
    hf = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    assert_engine_parity(baichuan, hf)


def test_mapping_covers_every_tensor(pair, ref_backend, tmp_path):
    """A tensor the mapping has no place for is an unknown variant: refused, naming the tensor."""
    llama, _ = pair
    odd = baichuan_from_llama(llama, tmp_path / "odd", extra={"model.layers.0.self_attn.alibi_slopes": torch.ones(5)})
    with pytest.raises(UnsupportedModelError, match="alibi_slopes"):
        load_model(odd, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))


def _alibi_reference_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Baichuan-13B's attention written from torch ops (HF has no Baichuan): softmax(q.k * scaling +
    slope_h * k_pos + causal mask) v, slopes from Baichuan's ``_get_interleave`` formula (the closed form below,
    written out here rather than imported from pagedllm). Single unpadded sequences only, as the tests use it."""
    import math

    h, q_len, k_len = query.shape[1], query.shape[2], key.shape[2]

    def slopes(n):
        if math.log2(n).is_integer():
            start = 2 ** (-2 ** -(math.log2(n) - 3))
            return [start * start ** i for i in range(n)]
        closest = 2 ** math.floor(math.log2(n))
        return slopes(closest) + slopes(2 * closest)[0::2][: n - closest]

    groups = h // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    k_pos = torch.arange(k_len)[None, :]
    q_pos = torch.arange(k_len - q_len, k_len)[:, None]
    bias = torch.tensor(slopes(h))[:, None, None] * k_pos.float()  # Baichuan adds slope * key position
    bias = bias.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(query @ key.transpose(-1, -2) * scaling + bias, dim=-1)
    return (probs @ value).transpose(1, 2).contiguous(), probs


@pytest.fixture
def baichuan13b_oracle(pair, monkeypatch):
    """HF's Llama over the same weights with rotary removed and the ALiBi reference attention above."""
    from transformers import AttentionInterface

    AttentionInterface.register("alibi_reference", _alibi_reference_attention)
    monkeypatch.setattr("transformers.models.llama.modeling_llama.apply_rotary_pos_emb",
                        lambda q, k, cos, sin, *a, **kw: (q, k))
    return AutoModelForCausalLM.from_pretrained(pair[0], dtype=torch.float32,
                                                attn_implementation="alibi_reference").eval()


@pytest.fixture(scope="module")
def baichuan13b(pair, tmp_path_factory):
    """The pair's weights as a 13B-layout checkpoint (BaichuanForCausalLM, hidden size not 4096: ALiBi)."""
    return baichuan_from_llama(pair[0], tmp_path_factory.mktemp("baichuan13b"), arch="BaichuanForCausalLM")


def test_baichuan_13b_alibi_logits_match_reference(baichuan13b, baichuan13b_oracle, ref_backend):
    from pagedllm.models.alibi import uses_alibi

    assert uses_alibi(load_config(baichuan13b))
    ours = load_model(baichuan13b, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert ours.layers[0].self_attn.alibi
    prompts = parity_prompts(500)
    with torch.inference_mode():
        expected = [baichuan13b_oracle(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match("baichuan13b", run_schedule(ours, ref_backend, prompts, schedule), expected)


def test_baichuan_13b_alibi_greedy_parity_engine(baichuan13b, baichuan13b_oracle):
    assert_engine_parity(baichuan13b, baichuan13b_oracle)


def test_baichuan_fallback_is_refused(pair):
    from pagedllm import LLM

    with pytest.raises(UnsupportedModelError, match="BaiChuanForCausalLM.*transformers fallback cannot load it"):
        LLM(pair[1], device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
            model_impl="transformers")


def test_baichuan2_normhead_normalises_lm_head_rows():
    w = torch.randn(7, 5) * 3
    src = BaichuanWeights(DictWeights({"lm_head.weight": w.clone()}), SimpleNamespace(vocab_size=125696))
    torch.testing.assert_close(src.take("lm_head.weight"), torch.nn.functional.normalize(w))
    plain = BaichuanWeights(DictWeights({"lm_head.weight": w.clone()}), SimpleNamespace(vocab_size=64000))
    assert torch.equal(plain.take("lm_head.weight"), w)
