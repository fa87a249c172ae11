"""GGUF for GLM-4, ChatGLM, Baichuan and DeepSeek-V2/V3: archs transformers' GGUF config mapping does not know, so the
config is built from the file's metadata by ``gguf_archs`` and the tensors read through gguf-py's name map. Tiny
checkpoints laid out as llama.cpp's converter writes them (``gguf_utils.write_hf_as_gguf``) load natively and match
HF on the same weights; their tokenizers are read by transformers' GGUF tokenizer conversion.

GLM-4 (arch ``glm4``): partial rotary from ``glm4.rope.dimension_count`` (0.75 of the head here), interleaved rotary
pairs (GGML "norm" rope: rows not permuted), qkv bias, fused ``gate_up_proj`` as ``ffn_up``, post-attention/post-MLP
norms. Baichuan (arch ``baichuan``): llama.cpp splits ``W_pack`` into q/k/v and permutes q/k as for Llama, so the
oracle is HF Llama on the same weights (as test_remote_layouts.py does for the safetensors layout); not 40
layers, so the 7B (rotary) layout. ChatGLM (arch ``chatglm``): a HF Glm checkpoint re-laid as ChatGLM2/3 (fused
``attn_qkv`` with bias, ``dense_h_to_4h`` as ``ffn_up``), oracle HF Glm. DeepSeek (arch ``deepseek2``): the tiny
models of test_deepseek_mla.py, ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` as newer converters write
it (V2 group-limited softmax routing, V3 sigmoid routing with ``exp_probs_b`` and YaRN) or kept whole with the older
metadata (a V2-Lite-like greedy router). F32 files: logits within 1e-4 of HF on the original checkpoint; Q8_0 files:
of HF on the dequantized weights (a ``gguf.quants`` round trip, independent of our reader)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from gguf_utils import assert_engine_greedy_matches_hf, finish, gguf_with_oracle, hf_eager, write_hf_as_gguf
from pagedllm import LLM, SamplingParams
from pagedllm.models import load_config, load_model
from pagedllm.models.gguf_weights import read_tensors
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, parity_prompts, run_schedule
from tiny_models import make_fallback_model, make_tiny_model

#: GLM-4 with rows that split into Q8_0 blocks (hidden 256, 8 heads of 32, 24 of them rotary).
GLM4_GGUF = dict(hidden_size=256, num_attention_heads=8, head_dim=32, intermediate_size=384, vocab_size=512)
#: ChatGLM: hidden / heads is the head size (the converter writes no head size), rows split into Q8_0 blocks.
CHATGLM_GGUF = dict(hidden_size=256, num_attention_heads=8, head_dim=32, num_key_value_heads=2, intermediate_size=384,
                    vocab_size=512)
#: DeepSeek-V3 with every weight's rows in Q8_0 blocks (k_b's rows are the no-rope head dim: 32).
DEEPSEEK_Q8 = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=64,
                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, intermediate_size=128,
                   moe_intermediate_size=64, vocab_size=512)
#: A GGUF keeps one YaRN mscale (``yarn_log_multiplier``): llama.cpp's graph is HF's when mscale == mscale_all_dim.
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}
#: family -> (GGUF architecture, HF model_type of the config the file loads with, HF architecture)
ARCH = {"glm4": ("glm4", "glm4", "Glm4ForCausalLM"), "baichuan": ("baichuan", "llama", "LlamaForCausalLM"),
        "chatglm": ("chatglm", "glm", "GlmForCausalLM"), "glm": ("chatglm", "glm", "GlmForCausalLM"),
        "deepseek_v2": ("deepseek2", "deepseek_v2", "DeepseekV2ForCausalLM"),
        "deepseek_v2_lite": ("deepseek2", "deepseek_v2", "DeepseekV2ForCausalLM"),
        "deepseek_v3": ("deepseek2", "deepseek_v3", "DeepseekV3ForCausalLM")}


def write_family_gguf(family: str, out_dir: str, qtype: str) -> tuple[str, str]:
    """(GGUF path, HF folder with the weights the GGUF holds)."""
    hf_dir = os.path.join(out_dir, "hf")
    kwargs = {}
    if family == "glm4":
        make_fallback_model("glm4", hf_dir, **GLM4_GGUF)
    elif family == "chatglm":
        make_fallback_model("glm", hf_dir, **CHATGLM_GGUF)
    elif family == "glm":  # transformers' GlmForCausalLM (GLM-4-9B-hf), which llama.cpp also writes as arch chatglm
        make_fallback_model("glm", hf_dir, **CHATGLM_GGUF)
        kwargs["relay_chatglm"] = False
    elif family == "deepseek_v2":
        make_fallback_model("deepseek_v2", hf_dir)
    elif family == "deepseek_v2_lite":  # an older converter's file: attn_kv_b whole, no groups / gating keys
        make_fallback_model("deepseek_v2", hf_dir, topk_method="greedy", n_group=1, topk_group=1)
        kwargs["split_kv_b"] = False
    elif family == "deepseek_v3":
        make_fallback_model("deepseek_v3", hf_dir, rope_parameters=YARN, **(DEEPSEEK_Q8 if qtype != "F32" else {}))
    else:  # Baichuan: multi-head attention (W_pack holds as many k/v heads as q heads)
        make_tiny_model("llama", hf_dir, num_key_value_heads=4)
    return gguf_with_oracle(hf_dir, out_dir, family, ARCH[family][0], qtype, **kwargs)


def assert_config_matches(config, want) -> None:
    """Every field the file carries equals HF's (floats as float32, as the file stores them)."""
    keys = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "rope_parameters"]
    if want.model_type.startswith("deepseek"):
        keys += ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
                 "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "n_group", "topk_group"]
        keys += ["topk_method"] if want.model_type == "deepseek_v2" else []
    else:
        keys.append("head_dim")
    close = lambda a, b: a == (pytest.approx(b, rel=1e-6) if isinstance(b, float) else b)  # noqa: E731
    for key in keys:
        ours, hf = getattr(config, key), getattr(want, key)
        if isinstance(hf, dict):
            assert all(close(ours.get(k), v) for k, v in hf.items()), (key, ours, hf)
        else:
            assert close(ours, hf), (key, ours, hf)


@pytest.mark.parametrize("family,qtype", [("glm4", "F32"), ("glm4", "Q8_0"), ("baichuan", "F32"),
                                          ("baichuan", "Q8_0"), ("chatglm", "F32"), ("chatglm", "Q8_0"),
                                          ("glm", "Q8_0"),
                                          ("deepseek_v2", "F32"), ("deepseek_v2_lite", "F32"),
                                          ("deepseek_v3", "F32"), ("deepseek_v3", "Q8_0")])
def test_gguf_logits_match_hf(tmp_path, ref_backend, family, qtype):
    path, oracle = write_family_gguf(family, str(tmp_path), qtype)
    hf = hf_eager(oracle)
    config = load_config(path)
    assert (config.model_type, config.architectures) == (ARCH[family][1], [ARCH[family][2]])
    assert_config_matches(config, hf.config)
    if family.startswith("deepseek"):
        tensors = {t.name for t in read_tensors(path)[1]}
        assert ("blk.0.attn_kv_b.weight" in tensors) == (family == "deepseek_v2_lite")
        assert ("blk.1.exp_probs_b.bias" in tensors) == (family == "deepseek_v3")
    elif family in ("chatglm", "glm"):
        assert config.attention_bias and config.rope_parameters["partial_rotary_factor"] == 0.5
    elif family == "glm4":
        assert config.attention_bias and config.rope_parameters["partial_rotary_factor"] == 0.75
    else:
        assert not getattr(config, "pagedllm_alibi")
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(f"{family} {qtype} gguf", run_schedule(ours, ref_backend, prompts, schedule),
                                expected)


@pytest.mark.parametrize("family", ["glm4", "baichuan", "chatglm", "deepseek_v3"])
def test_gguf_engine_greedy_matches_hf(tmp_path, family):
    """Through the engine: chunked prefill (16-token budget), prefix caching, a mixed batch of 8 (lengths 1-37)."""
    path, oracle = write_family_gguf(family, str(tmp_path), "Q8_0")
    assert_engine_greedy_matches_hf(path, oracle)


def test_baichuan_13b_gguf_runs_alibi(tmp_path, ref_backend, monkeypatch):
    """40 layers is Baichuan-13B to llama.cpp: ALiBi, no rotary. Oracle: HF Llama on the same weights with rotary
    removed and the torch-ops ALiBi attention of tests/models/test_remote_layouts.py."""
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
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf.eval()(torch.tensor([p])).logits[0] for p in prompts]
        # one prefill step: 40 layers of the reference ALiBi attention per decode step are slow (chunked ALiBi is
        # covered by tests/models/test_remote_layouts.py on the same model code)
        assert_logits_match("baichuan13b gguf", run_schedule(ours, ref_backend, prompts, FULL_PREFILL), expected)


def test_glm4_gguf_tokenizer_matches_hf(tmp_path):
    """A glm4 file carrying a BPE tokenizer as llama.cpp's converter writes it (SmolLM2's real one, pre-tokenizer
    "smollm" as the converter's hash names it): the engine serves text, and its tokenizer encodes and decodes as the
    HF tokenizer the file was written from."""
    from transformers import AutoTokenizer

    from server_utils import tiny_chat_model

    tok_dir = tiny_chat_model()
    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    hf_dir = make_fallback_model("glm4", tmp_path / "hf", vocab_size=len(hf_tok), hidden_size=64, num_attention_heads=2,
                                 head_dim=32, num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True,
                                 bos_token_id=hf_tok.bos_token_id, eos_token_id=hf_tok.eos_token_id,
                                 pad_token_id=hf_tok.pad_token_id)
    path = write_hf_as_gguf(hf_dir, str(tmp_path / "tiny-glm4-tok.gguf"), "glm4", tokenizer=(tok_dir, "smollm"))
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    tok = llm.get_tokenizer()
    for text in ["Hello world!", "  two spaces,\nnewlines\tand 12345 digits", "日本語 and émoji 🦙",
                 "<|im_start|>user\nhi<|im_end|>"]:
        ids = hf_tok.encode(text)
        assert tok.encode(text) == ids
        assert tok.decode(ids) == hf_tok.decode(ids)
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == hf_tok.decode(list(out.token_ids))


def test_baichuan_gguf_sentencepiece_tokenizer_matches_transformers(tmp_path):
    """A baichuan file carrying a SentencePiece ("llama") vocabulary, as Baichuan's and ChatGLM3's are: its
    tokenizer encodes and decodes as transformers' own GGUF tokenizer of the same vocabulary in a llama file (an arch
    transformers reads), byte fallback included; the engine serves text with it."""
    from transformers import AutoTokenizer

    from gguf_utils import spm_pieces

    pieces = spm_pieces(["Hello", "world", "the", "is", "tiny", "model"])
    hf_dir = make_tiny_model("llama", tmp_path / "hf", num_key_value_heads=4, vocab_size=len(pieces))
    path = write_hf_as_gguf(hf_dir, str(tmp_path / "tiny-baichuan.gguf"), "baichuan", tokenizer=pieces)
    write_hf_as_gguf(hf_dir, str(tmp_path / "tiny-llama.gguf"), "llama", tokenizer=pieces)
    want = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny-llama.gguf")
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, kv_cache_memory=16 << 20)
    tok = llm.get_tokenizer()
    for text in ["Hello world", "the tiny model is the model", "Helloworld!  two", "日本 and é"]:
        ids = want.encode(text)
        assert tok.encode(text) == ids and ids[0] == 1
        assert tok.decode(ids) == want.decode(ids)
    assert any(3 <= i < 259 for i in want.encode("日本"))  # byte fallback pieces
    out = llm.generate(["Hello world"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == want.encode("Hello world") and len(out.outputs[0].token_ids) == 4


def test_deepseek2_gguf_without_a_key_is_refused_naming_it(tmp_path):
    """A deepseek2 file lacking a key the config needs is refused naming the key, and so is a rope scaling the
    mapping does not know."""
    import gguf

    def write(name: str, scaling: str | None) -> str:
        w = gguf.GGUFWriter(str(tmp_path / name), "deepseek2")
        w.add_block_count(2)
        w.add_embedding_length(64)
        w.add_feed_forward_length(128)
        w.add_context_length(256)
        w.add_head_count(2)
        w.add_layer_norm_rms_eps(1e-6)
        if scaling is not None:
            w.add_rope_scaling_type(gguf.RopeScalingType(scaling))
        w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
        return finish(w, str(tmp_path / name))

    with pytest.raises(ValueError, match="'deepseek2.rope.dimension_count'"):
        load_config(write("no-rope-dim.gguf", None))
    with pytest.raises(ValueError, match="deepseek2.*'linear'"):
        load_config(write("linear.gguf", "linear"))
