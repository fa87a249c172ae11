"""GGUF of a model with recurrent state (issue 28): LFM2 as llama.cpp's converter writes it (``LFM2Model`` of
convert_hf_to_gguf.py: arch ``lfm2``, one ``attention.head_count_kv`` per layer, 0 on the conv layers, the final FFN
width as ``feed_forward_length``, ``shortconv.l_cache``, the depthwise conv squeezed to ``[dim, L]``, no ``output``
tensor for a tied head, a vocabulary in ``tokenizer.ggml.tokens``), loaded natively: the config through transformers'
GGUF reader (which maps ``lfm2``), the conv weight unsqueezed back by the weight reader. F32: greedy tokens of the
original safetensors model through chunked prefill and mixed batches, and the state slots used. Q8_0 (linear weights
block-quantized by gguf's reference quantizer): the tokens of HF transformers reading the same file.

The other stateful archs llama.cpp writes (``mamba2``, ``granitehybrid``, ``qwen3next``) are not loaded: transformers'
GGUF reader builds no config for them (tested below), so they would need configs of our own and their tensor
transforms (Mamba2's ``A = -exp(A_log)``, reshaped ``D`` / norm, renamed ``dt_bias``); see docs/models.md."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_parity import hf_model, run
import hf_oracle
from pagedllm import LLM
from pagedllm.models import load_config
from pagedllm.models.lfm2 import Lfm2CausalLM
from stateful import LFM2, LFM2_VOCAB
from tiny_models import save_random_model

#: LFM2 as released (no conv biases: llama.cpp's lfm2 graph has none), vocabulary a multiple of the Q8_0 block
CONFIG = dict(LFM2, conv_bias=False)
PROMPT_LENS = (1, 2, 7, 9, 16, 17, 23, 37)


def write_lfm2_gguf(hf_dir: str, path: str, qtype: str = "F32") -> str:
    """The safetensors LFM2 in ``hf_dir`` as llama.cpp's converter writes it to ``path``; 2-D weights whose rows split
    into ``qtype`` blocks are quantized (embeddings and the conv stay F32, as the converter keeps 1-D/odd tensors)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    w = gguf.GGUFWriter(path, "lfm2")
    w.add_name("tiny-lfm2")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(int(hf["model.layers.0.feed_forward.w1.weight"].shape[0]))  # the adjusted width
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([c.num_key_value_heads if t == "full_attention" else 0 for t in c.layer_types])
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_shortconv_l_cache(c.conv_L_cache)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    w.add_token_types([gguf.TokenType.NORMAL] * c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LFM2, c.num_hidden_layers)
    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    for hf_name, t in hf.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if gname.endswith("shortconv.conv.weight"):
            data = data.squeeze(1)  # the converter's "conv op requires 2d tensor"
        if qtype != "F32" and data.ndim == 2 and gname != "token_embd.weight" and data.shape[-1] % block == 0 \
                and not gname.endswith("shortconv.conv.weight"):
            w.add_tensor(gname, quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gguf_lfm2")
    hf_dir = save_random_model(CONFIG, root / "hf")
    out = {"hf": hf_dir}
    for qtype in ("F32", "Q8_0"):
        os.makedirs(root / qtype)
        out[qtype] = write_lfm2_gguf(hf_dir, str(root / qtype / f"tiny-lfm2-{qtype}.gguf"), qtype)
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, LFM2_VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _engine(path: str) -> LLM:
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=8,
               max_num_batched_tokens=16, kv_cache_memory=8 << 20)


def test_lfm2_gguf_config_is_the_checkpoints(files):
    """transformers' GGUF reader gives back the layer kinds (from the per-layer KV head counts), the final FFN width
    (auto-adjust off) and the conv cache length."""
    ours, theirs = load_config(files["F32"]), load_config(files["hf"])
    assert ours.layer_types == theirs.layer_types == ["conv", "full_attention", "conv", "conv", "full_attention"]
    assert ours.conv_L_cache == theirs.conv_L_cache and not ours.conv_bias
    assert ours.intermediate_size == 96 and not ours.block_auto_adjust_ff_dim and ours.tie_word_embeddings


def test_lfm2_gguf_f32_greedy_matches_the_safetensors_model(files):
    """8 prompts of 1..37 tokens under a 16-token budget (chunks continue their conv state, decodes mixed in): HF's
    greedy tokens on the original checkpoint; the state slots are used and given back."""
    llm = _engine(files["F32"])
    eng = llm.llm_engine
    assert isinstance(eng.model, Lfm2CausalLM) and eng.kv.state_slots is not None
    prompts = _prompts()
    got = run(llm, prompts, max_tokens=16)
    assert got == [hf_oracle.hf_greedy(hf_model(files["hf"]), p, 16) for p in prompts]
    assert eng.kv.state_slots.num_free == eng.kv.state_slots.num_slots


def test_lfm2_gguf_q8_0_matches_hf_reading_the_same_file(files):
    path = files["Q8_0"]
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    llm = _engine(path)
    prompts = _prompts()
    got = run(llm, prompts, max_tokens=16)
    assert got == [hf_oracle.hf_greedy(hf, p, 16) for p in prompts]


@pytest.mark.parametrize("arch", ["mamba2", "granitehybrid", "qwen3next"])
def test_transformers_builds_no_config_for_the_other_stateful_archs(tmp_path, arch):
    """Why only LFM2 loads: transformers refuses the config of a GGUF of llama.cpp's other stateful archs (a header
    alone shows it), so there is no config or tokenizer to build the model from."""
    import gguf
    from transformers import AutoConfig

    path = str(tmp_path / f"{arch}.gguf")
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=f"architecture {arch} is not supported"):
        AutoConfig.from_pretrained(str(tmp_path), gguf_file=f"{arch}.gguf")
