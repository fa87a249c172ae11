"""StableLM natively (``models/stablelm.py``) vs HF's ``StableLmForCausalLM`` on tiny random checkpoints with odd
shapes (head 48, vocab 500): fp32 logits within 1e-4 through the paged cache (full prefill and chunks beside
decodes) and greedy parity through the engine, over the config fields HF's StableLM reads -- partial rotary (0.25,
0.5, none, whole head with linear scaling), q/k/v bias, parallel residual on and off, per-head q/k LayerNorm on and
off, GQA and MHA, tied and untied heads, a non-silu activation; what this module cannot run as HF does is refused
naming the field. GGUF: files laid out as llama.cpp's ``StableLMModel`` converter writes them (no rope base, the
rotary width as ``rope.dimension_count``, per-head norms stacked) load with the original config and match HF."""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from gguf_utils import finish
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, hf_eager, parity_prompts, run_schedule
from model_parity import assert_engine_parity
from pagedllm.errors import UnsupportedModelError
from pagedllm.models import load_config, load_model
from pagedllm.models.stablelm import StableLmCausalLM
from tiny_models import save_random_model

_BASE = dict(model_type="stablelm", vocab_size=500, hidden_size=480, intermediate_size=320, num_hidden_layers=2,
             num_attention_heads=10, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.15,
             layer_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
CONFIGS = {
    # StableLM 2 1.6B: q/k/v bias, sequential residual, rotary over a quarter of the head (12 of 48).
    "stablelm2": dict(_BASE, partial_rotary_factor=0.25, use_qkv_bias=True, use_parallel_residual=False,
                      qk_layernorm=False),
    # StableLM 2 12B: parallel residual, per-head q/k LayerNorm (10 query heads, 2 KV heads), no bias.
    "stablelm2_12b": dict(_BASE, partial_rotary_factor=0.25, use_qkv_bias=False, use_parallel_residual=True,
                          qk_layernorm=True),
    # The other combinations: q/k norm with bias and the sequential residual, MHA, half rotary at another base, a
    # tied head.
    "stablelm_mixed": dict(_BASE, partial_rotary_factor=0.5, rope_theta=500000.0, use_qkv_bias=True,
                           use_parallel_residual=False, qk_layernorm=True, num_key_value_heads=10,
                           tie_word_embeddings=True),
    # No rotary at all (HF rotates nothing), parallel residual with bias, gelu instead of silu.
    "stablelm_no_rotary": dict(_BASE, partial_rotary_factor=0.0, use_qkv_bias=True, use_parallel_residual=True,
                               qk_layernorm=False, hidden_act="gelu"),
    # The whole head rotated, with linear rope scaling (HF's ROPE_INIT_FUNCTIONS).
    "stablelm_full_rotary": dict(_BASE, use_qkv_bias=False, use_parallel_residual=False, qk_layernorm=True,
                                 rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 1.0}),
}
ENGINE = list(CONFIGS)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def stablelm_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stablelm")
    return {name: save_random_model(kw, root / name) for name, kw in CONFIGS.items()}


def _assert_logits(name: str, ours, hf, backend, schedules=(FULL_PREFILL, CHUNKED)) -> None:
    """Teacher-forced logits of ``ours`` through the paged cache vs HF's, per schedule."""
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in schedules:
            assert_logits_match(name, run_schedule(ours, backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stablelm_logits_match_hf(stablelm_dirs, ref_backend, name):
    path = stablelm_dirs[name]
    hf = hf_eager(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=CPU)
    assert isinstance(ours, StableLmCausalLM)
    kw = CONFIGS[name]
    assert (ours.num_heads, ours.num_kv_heads, ours.head_size) == (10, kw["num_key_value_heads"], 48)
    layer = ours.layers[0]
    assert (layer.post_attention_layernorm is None) == kw["use_parallel_residual"]
    assert (layer.self_attn.q_layernorm is not None) == kw["qk_layernorm"]
    assert (layer.self_attn.qkv_proj.bias is not None) == kw["use_qkv_bias"]
    prf = kw.get("partial_rotary_factor", kw.get("rope_parameters", {}).get("partial_rotary_factor"))
    assert layer.self_attn.rotary_dim == int(48 * prf) == ours.cos_sin_cache.shape[-1]
    _assert_logits(name, ours, hf, ref_backend)


@pytest.mark.parametrize("name", ENGINE)
def test_stablelm_greedy_parity_engine(stablelm_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16), chunked prefill, prefix hits, on the CPU
    backend's own kernels."""
    llm = assert_engine_parity(stablelm_dirs[name], hf_eager(stablelm_dirs[name]))
    assert isinstance(llm.llm_engine.model, StableLmCausalLM)


@pytest.mark.parametrize("field, value, words", [
    ("partial_rotary_factor", 0.3125, "partial_rotary_factor gives a rotary width of 15"),  # odd: HF fails too
    ("partial_rotary_factor", 1.5, "partial_rotary_factor gives a rotary width of 72"),
    ("head_dim", 64, "head_dim 64 differs"),
    ("num_key_value_heads", 3, "num_key_value_heads 3 does not divide"),
    ("hidden_act", "no_such_act", "hidden_act 'no_such_act'"),
])
def test_stablelm_refuses_what_it_cannot_run_as_hf(stablelm_dirs, ref_backend, field, value, words):
    """Refused before any weight is read, the message naming the field."""
    path = stablelm_dirs["stablelm2"]
    config = copy.deepcopy(load_config(path))
    if field == "partial_rotary_factor":
        config.rope_parameters = dict(config.rope_parameters, partial_rotary_factor=value)
    else:
        setattr(config, field, value)
    with pytest.raises(UnsupportedModelError, match=words):
        load_model(path, backend=ref_backend, dtype=torch.float32, device=CPU, config=config)


def test_stablelm_is_native_and_listed():
    """``auto`` picks the native module (transformers' StableLM cannot run on the fallback), and ``pagedllm
    models`` lists it with its oracle tests."""
    from pagedllm.models.arch import resolve_model_impl
    from pagedllm.models.support import rows

    config = AutoConfig.for_model("stablelm", **{k: v for k, v in _BASE.items() if k != "model_type"})
    assert resolve_model_impl(config, "auto") == ("StableLmForCausalLM", "native")
    row = next(r for r in rows() if r["architecture"] == "StableLmForCausalLM")
    assert row["path"] == "native" and "test_stablelm.py" in row["verified"] and row["gguf"].startswith("yes")


# --- GGUF ---------------------------------------------------------------------------------------------------------


def write_stablelm_gguf(hf_dir: str, path: str, qtype: str = "F32") -> str:
    """``hf_dir`` as llama.cpp's ``StableLMModel`` converter writes it: its keys only (no rope base: llama.cpp runs
    10000), the rotary width as ``rope.dimension_count``, ``use_parallel_residual``, per-head q/k norms stacked into
    one ``[heads, head_size]`` tensor, a tied head left out; 2-D weights but the embedding in ``qtype``."""
    import gguf
    from gguf.quants import quantize

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    w = gguf.GGUFWriter(path, "stablelm")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    head = c.hidden_size // c.num_attention_heads
    w.add_rope_dimension_count(int(c.rope_parameters["partial_rotary_factor"] * head))
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_parallel_residual(c.use_parallel_residual)
    w.add_layer_norm_eps(c.layer_norm_eps)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    sd = model.state_dict()
    for i in range(c.num_hidden_layers):  # the converter's _stack_qk_norm
        for norm, heads in (("q_layernorm", c.num_attention_heads), ("k_layernorm", c.num_key_value_heads)):
            p = f"model.layers.{i}.self_attn.{norm}"
            if f"{p}.norms.0.weight" in sd:
                sd[f"{p}.weight"] = torch.stack([sd.pop(f"{p}.norms.{h}.weight") for h in range(heads)])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.STABLELM, c.num_hidden_layers)
    qt = gguf.GGMLQuantizationType[qtype]
    for hf_name, t in sd.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if qtype != "F32" and data.ndim == 2 and gname != "token_embd.weight" and not gname.endswith("norm.weight"):
            w.add_tensor(gname, quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, data)
    return finish(w, path)


_CONFIG_FIELDS = ("use_qkv_bias", "use_parallel_residual", "qk_layernorm", "tie_word_embeddings", "vocab_size",
                  "num_key_value_heads", "rope_parameters")


@pytest.mark.parametrize("name", ["stablelm2_12b", "stablelm_mixed"])
def test_stablelm_gguf_matches_hf(stablelm_dirs, ref_backend, tmp_path, name):
    """F32 files: the completed config is the original one (transformers' GGUF config alone drops the rotary width
    and the q/k norms), and logits match HF on the original checkpoint; the converter writes no rope base, so a file
    of a model trained at another base runs at 10000, as llama.cpp runs it."""
    hf_dir = stablelm_dirs[name]
    path = write_stablelm_gguf(hf_dir, str(tmp_path / f"tiny-{name}.gguf"))
    want, config = AutoConfig.from_pretrained(hf_dir), load_config(path)
    if name == "stablelm_mixed":
        want.rope_parameters = dict(want.rope_parameters, rope_theta=10000.0)  # as llama.cpp runs the file
    assert {k: getattr(config, k) for k in _CONFIG_FIELDS} == {k: getattr(want, k) for k in _CONFIG_FIELDS}
    assert config.layer_norm_eps == pytest.approx(want.layer_norm_eps)  # stored as float32
    hf = AutoModelForCausalLM.from_config(want, dtype=torch.float32, attn_implementation="eager").eval()
    hf.load_state_dict(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict())
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=CPU, config=config)
    assert isinstance(ours, StableLmCausalLM)
    _assert_logits(f"{name} gguf", ours, hf, ref_backend, (CHUNKED,))


def test_stablelm_q8_gguf_matches_hf_reading_it(stablelm_dirs, ref_backend, tmp_path):
    """StableLM 2 1.6B's layout with Q8_0 linears: logits match transformers reading the same file (with the
    completed config), and the engine's greedy tokens match it."""
    path = write_stablelm_gguf(stablelm_dirs["stablelm2"], str(tmp_path / "tiny-stablelm2-q8.gguf"), "Q8_0")
    config = load_config(path)
    assert config.use_qkv_bias and not config.use_parallel_residual and not config.qk_layernorm
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), config=config,
                                              dtype=torch.float32, attn_implementation="eager").eval()
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=CPU)
    _assert_logits("stablelm2 q8 gguf", ours, hf, ref_backend, (CHUNKED,))
    llm = assert_engine_parity(path, hf, skip_tokenizer_init=True)
    assert isinstance(llm.llm_engine.model, StableLmCausalLM)
