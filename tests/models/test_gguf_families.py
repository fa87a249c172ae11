"""GGUF for the native families beyond Llama whose GGUF metadata transformers reads: a tiny checkpoint written with
``gguf.GGUFWriter`` (linear weights Q8_0, the rest F32) loads natively and matches HF reading the same file.

Falcon: transformers' GGUF config keeps only what Falcon-7B's layout needs (multi-query, parallel attention,
ffn = 4 x hidden); a Falcon-40B/180B-style file (several KV heads, ``ln_attn`` / ``ln_mlp`` as ``attn_norm_2`` /
``attn_norm``, q/k/v reordered by llama.cpp's converter) is completed from the file and matches HF Falcon on the
original checkpoint (transformers cannot read it). DeepSeek-V2/V3 (``deepseek2``), GLM-4, ChatGLM and Baichuan:
transformers has no GGUF config for them; pagedllm builds it from the metadata
(tests/models/test_gguf_glm_baichuan_deepseek.py). Gemma 2 / Gemma 3: RMSNorm weights stored as ``1 + w`` by llama.cpp's
converter, undone at load as transformers does."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_utils import add_model_header, assert_engine_greedy_matches_hf, finish
from model_parity import NEW_TOKENS, mixed_batch
import hf_oracle
from pagedllm import LLM, SamplingParams
from pagedllm.models import load_config, load_model
from pagedllm.models.falcon import FalconCausalLM
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, parity_prompts, run_schedule
from tiny_models import make_fallback_model

# Falcon-7B's layout at odd shapes (head 48, vocab 500): MQA, parallel attention, tied head, ffn = 4 x hidden.
FALCON_7B_LIKE = dict(ffn_hidden_size=4 * 480, layer_norm_epsilon=1e-5)


def falcon_qkv_as_converter(t: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """llama.cpp's Falcon q/k/v reorder (``FalconModel.modify_tensors``): per KV group ``[q.., k, v]`` -> all queries,
    all keys, all values."""
    d = t.shape[-1] // heads
    qkv = t.view(kv_heads, heads // kv_heads + 2, d, -1)
    q = qkv[:, :-2].reshape(heads * d, -1)
    k, v = (qkv[:, [i]].reshape(kv_heads * d, -1) for i in (-2, -1))
    return torch.cat((q, k, v)).reshape_as(t)


def write_gguf(arch: str, hf_dir: str, out_dir, kv_heads: int, ffn: int, eps_rms: bool, qtype: str = "Q8_0") -> str:
    """``hf_dir``'s weights as ``<out_dir>/tiny-<arch>.gguf``: metadata as llama.cpp's converter writes it, 2-D
    weights ``qtype`` (Q8_0: dequantized at load, ``gguf.quants``), the rest F32, a tied head left out."""
    import gguf
    from gguf.quants import quantize

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    path = os.path.join(out_dir, f"tiny-{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    add_model_header(w, c, ffn=ffn, kv_heads=kv_heads)
    rp = getattr(c, "rope_parameters", None) or {}
    if eps_rms:
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_dimension_count(int(rp.get("partial_rotary_factor", 1.0) * c.hidden_size) // c.num_attention_heads)
    else:
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_pad_token_id(c.pad_token_id)
    if rp.get("rope_type") == "longrope":  # as Phi3MiniModel writes it: the factors as tensors, the lengths as keys
        orig = rp["original_max_position_embeddings"]
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_orig_ctx_len(orig)
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(rp["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rp["short_factor"], dtype=np.float32))
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if arch == "falcon" and "query_key_value" in hf_name:
            t = falcon_qkv_as_converter(t, c.num_attention_heads, kv_heads)
        data = t.numpy().astype(np.float32)
        if data.ndim == 2 and name != "token_embd.weight" and qtype == "Q8_0":
            w.add_tensor(name, quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, data)
    return finish(w, path)


def write_falcon_gguf(out_dir, kv_heads: int = 1) -> str:
    hf_dir = make_fallback_model("falcon_mqa", os.path.join(out_dir, "hf"), **FALCON_7B_LIKE)
    return write_gguf("falcon", hf_dir, out_dir, kv_heads, FALCON_7B_LIKE["ffn_hidden_size"], eps_rms=False)


def write_phi3_gguf(out_dir, name: str = "phi3") -> str:
    """Phi-3 (fused qkv_proj / gate_up_proj: GGUF's attn_qkv / ffn_up), no sliding window: transformers' GGUF
    config for phi3 carries none."""
    hf_dir = make_fallback_model(name, os.path.join(out_dir, "hf"), sliding_window=None)
    return write_gguf("phi3", hf_dir, out_dir, 2, 320, eps_rms=True)


@pytest.fixture(scope="module")
def falcon_gguf(tmp_path_factory) -> str:
    return write_falcon_gguf(tmp_path_factory.mktemp("gguf_falcon"))


@pytest.fixture(scope="module")
def phi3_gguf(tmp_path_factory) -> str:
    return write_phi3_gguf(tmp_path_factory.mktemp("gguf_phi3"))


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32, attn_implementation="eager").eval()


def test_falcon_gguf_logits_and_greedy_match_hf(falcon_gguf, ref_backend):
    hf = _hf(falcon_gguf)
    ours = load_model(falcon_gguf, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, FalconCausalLM) and ours.num_kv_heads == 1
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match("falcon gguf", run_schedule(ours, ref_backend, prompts, schedule), expected)
    llm = LLM(falcon_gguf, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              kv_cache_memory=16 << 20, max_num_batched_tokens=16, enable_prefix_caching=True)
    assert isinstance(llm.llm_engine.model, FalconCausalLM)
    wave = mixed_batch(hf.config.vocab_size)[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in wave],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for p, o in zip(wave, outs):
        assert list(o.outputs[0].token_ids) == hf_oracle.hf_greedy(hf, p, NEW_TOKENS)


def test_phi3_gguf_logits_match_hf(phi3_gguf, ref_backend):
    hf = _hf(phi3_gguf)
    ours = load_model(phi3_gguf, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert (ours.num_heads, ours.num_kv_heads, ours.head_size) == (10, 2, 48)
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match("phi3 gguf", run_schedule(ours, ref_backend, prompts, schedule), expected)


def test_phi3_longrope_gguf_short_and_long_factors(tmp_path, ref_backend):
    """A Phi-3-128k-style file (LongRoPE factors as tensors, original length and attention factor as keys; partial
    rotary 0.75, as Phi-4-mini): up to the original 64 positions the short factors, past them the long ones, each
    matching HF Phi-3 reading the same file with the completed config (transformers' own GGUF config drops the
    factors and the partial rotary)."""
    path = write_phi3_gguf(tmp_path, "phi3_longrope")
    config = load_config(path)
    assert config.rope_parameters["rope_type"] == "longrope" and config.original_max_position_embeddings == 64
    assert config.partial_rotary_factor == 0.75
    from transformers import AutoConfig

    want = AutoConfig.from_pretrained(os.path.join(tmp_path, "hf")).rope_parameters  # what the converter was given
    for key in ("long_factor", "short_factor"):
        np.testing.assert_allclose(config.rope_parameters[key], want[key], rtol=1e-6)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), config=config,
                                              dtype=torch.float32, attn_implementation="eager").eval()
    prompts = parity_prompts(hf.config.vocab_size)
    long_prompt = [[(7 * i) % 400 + 3 for i in range(90)]]
    with torch.inference_mode():
        short = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"), max_model_len=64)
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        assert_logits_match("phi3 longrope gguf short", run_schedule(short, ref_backend, prompts, CHUNKED), expected)
        long = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
        got = run_schedule(long, ref_backend, long_prompt, [[(0, 90)]])
        assert_logits_match("phi3 longrope gguf long", got, [hf(torch.tensor(long_prompt)).logits[0]])


def test_falcon_40b_layout_gguf_matches_hf(tmp_path, ref_backend):
    """Falcon-40B's layout (new decoder architecture: 2 KV groups of 5 queries, two layernorms, ffn 320 while the
    converter writes 4 x hidden) as llama.cpp writes it, F32: logits and the engine's greedy tokens match HF Falcon on
    the original checkpoint."""
    hf_dir = make_fallback_model("falcon_new_arch", os.path.join(tmp_path, "hf"))
    path = write_gguf("falcon", hf_dir, tmp_path, 2, 4 * 480, eps_rms=False, qtype="F32")
    config = load_config(path)
    assert (config.new_decoder_architecture, config.num_kv_heads, config.num_ln_in_parallel_attn,
            config.ffn_hidden_size) == (True, 2, 2, 320)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, FalconCausalLM) and ours.num_kv_heads == 2
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        assert_logits_match("falcon-40b gguf", run_schedule(ours, ref_backend, prompts, CHUNKED), expected)
    assert_engine_greedy_matches_hf(path, hf_dir)


def write_gemma_gguf(out_dir, name: str) -> str:
    """Gemma 2 / Gemma 3 text as llama.cpp's converter writes them: RMSNorm weights stored as ``1 + w``, head_dim as
    key/value length, the sliding window, Gemma 2's soft-capping keys, Gemma 3's global rope base and linear scaling;
    2-D weights Q8_0. The HF checkpoint holds what such a file can mean as llama.cpp runs it: query scale
    ``1/sqrt(head_dim)`` (not a 27B depth), Gemma 3's sliding pattern 6 and local rope base 10000."""
    import gguf
    from gguf.quants import quantize

    arch = {"gemma2": "gemma2", "gemma3": "gemma3"}[name]
    over = dict(query_pre_attn_scalar=48)  # = head_dim
    if name == "gemma3":
        over.update(num_hidden_layers=6, sliding_window_pattern=6)  # layers 0-4 sliding, 5 global
    hf_dir = make_fallback_model(name, os.path.join(out_dir, "hf"), **over)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    path = os.path.join(out_dir, f"tiny-{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    full = (c.rope_parameters or {}).get("full_attention", {})
    add_model_header(w, c, rope_theta=full.get("rope_theta", 10000.0))
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_pad_token_id(c.pad_token_id)
    if name == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    elif full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight":
            continue  # tied
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if hf_name.endswith("norm.weight"):
            data = data + 1
        if data.ndim == 2 and gname != "token_embd.weight" and data.shape[1] % 32 == 0:  # Q8_0 blocks of 32
            w.add_tensor(gname, quantize(data, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gname, data)
    return finish(w, path)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_gguf_logits_match_hf(tmp_path, ref_backend, name):
    """The ``1 + w`` norms are undone at load (a Gemma GGUF read without that is silently wrong: ~14 in logits), and
    the config transformers' GGUF mapping leaves out (soft-capping, query scale, Gemma 3's per-layer rope) is the
    original checkpoint's; HF reading the same file with that config is the oracle."""
    from transformers import AutoConfig

    path = write_gemma_gguf(tmp_path, name)
    config, want = load_config(path), AutoConfig.from_pretrained(os.path.join(tmp_path, "hf"))
    keys = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
            "layer_types", "rope_parameters")
    assert {k: getattr(config, k) for k in keys} == {k: getattr(want, k) for k in keys}
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), config=config,
                                              dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    prompts = parity_prompts(hf.config.vocab_size)  # lengths past the sliding window of 8
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(f"{name} gguf", run_schedule(ours, ref_backend, prompts, schedule), expected)
