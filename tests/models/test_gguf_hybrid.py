"""GGUF of models with recurrent state (issue 28), written as llama.cpp's converter (convert_hf_to_gguf.py) writes
them and loaded natively.

LFM2 (``LFM2Model``: arch ``lfm2``, one ``attention.head_count_kv`` per layer, 0 on the conv layers, the final FFN
width as ``feed_forward_length``, ``shortconv.l_cache``, the depthwise conv squeezed to ``[dim, L]``, no ``output``
tensor for a tied head, a vocabulary in ``tokenizer.ggml.tokens``): the config through transformers' GGUF reader
(which maps ``lfm2``), the conv weight unsqueezed back by the weight reader. F32: the original safetensors model's
greedy tokens through chunked prefill and mixed batches; Q8_0 (linear weights block-quantized by gguf's reference
quantizer): the tokens of HF transformers reading the same file.

Pure Mamba2 (``Mamba2Model``: arch ``mamba2``, ``ssm.*`` keys, ``A = -exp(A_log)`` and ``D`` as ``[heads, 1]``, the
gated norm as ``[groups, d_inner / groups]``, ``dt_bias`` as ``ssm_dt.bias``, the conv squeezed): transformers builds
no config for it, so pagedllm does (models/gguf_archs.py) and undoes the tensor transforms (models/gguf_ssm.py); F32
and Q8_0 against the original model (Q8_0: with gguf's own quantize/dequantize round trip of the linear weights).

``granitehybrid`` (Granite-4.0-H): transformers builds no config for it either (tested), so pagedllm does, and
undoes its tensor transforms (models/gguf_granite_hybrid.py): test_gguf_granite_hybrid.py. Qwen3.5 (``qwen35`` / ``qwen35moe``) and Qwen3-Next (``qwen3next``, whose config
transformers does not build either: pagedllm does): test_gguf_qwen35.py.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_parity import hf_model, run
from gguf_utils import add_placeholder_vocab
import hf_oracle
from pagedllm import LLM
from pagedllm.models import load_config
from pagedllm.models.lfm2 import Lfm2CausalLM
from hf_recompute import hf_greedy_recompute
from pagedllm.models.mamba2 import Mamba2CausalLM
from stateful import LFM2, LFM2_VOCAB, MAMBA2
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
    add_placeholder_vocab(w, c.vocab_size)
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
    """transformers refuses the config of a GGUF of llama.cpp's other stateful archs (a header alone shows it):
    Mamba2's, Qwen3-Next's and Granite-4.0-H's are built by pagedllm (below; test_gguf_qwen35.py,
    test_gguf_granite_hybrid.py)."""
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


#: Pure Mamba2 as released: no in/out projection biases (llama.cpp's mamba2 graph has none), conv biases, a vocabulary
#: that is a multiple of 16 (the converter pads the token list to one), d_inner = 2 x hidden (it requires that)
MAMBA2_GGUF = dict(MAMBA2, use_bias=False, vocab_size=320)


def write_mamba2_gguf(hf_dir: str, path: str, qtype: str = "F32") -> tuple[str, dict]:
    """The safetensors Mamba2 in ``hf_dir`` as llama.cpp's ``Mamba2Model`` writes it; returns (path, the HF state
    dict the file holds: linear weights through gguf's quantize/dequantize round trip when ``qtype`` is not F32)."""
    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    inner = int(c.expand * c.hidden_size)
    w = gguf.GGUFWriter(path, "mamba2")
    w.add_name("tiny-mamba2")
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(c.num_hidden_layers)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_inner_size(inner)
    w.add_ssm_state_size(c.state_size)
    w.add_ssm_time_step_rank(inner // c.head_dim)
    w.add_ssm_group_count(c.n_groups)
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    add_placeholder_vocab(w, c.vocab_size)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MAMBA2, c.num_hidden_layers)
    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    held = {}
    for hf_name, t in hf.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        conv_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias" if hf_name.endswith(".dt_bias") else hf_name
        gname = names.get_name(conv_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if gname.endswith("ssm_conv1d.weight"):
            data = data.squeeze()
        elif gname.endswith((".ssm_a", ".ssm_d")):
            data = data.reshape(*data.shape, 1)
        elif gname.endswith("ssm_norm.weight"):
            data = data.reshape(c.n_groups, inner // c.n_groups)
        if hf_name.endswith(".A_log"):
            data = -np.exp(data)
        if qtype != "F32" and gname.endswith(("ssm_in.weight", "ssm_out.weight", "output.weight")) \
                and data.shape[-1] % block == 0:
            packed = quantize(data, qt)
            w.add_tensor(gname, packed, raw_dtype=qt)
            t = torch.from_numpy(dequantize(packed, qt).copy())
        else:
            w.add_tensor(gname, data)
        held[hf_name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, held


@pytest.fixture(scope="module")
def mamba2_files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """qtype -> (GGUF path, HF folder holding the weights the GGUF holds)."""
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("gguf_mamba2")
    hf_dir = save_random_model(MAMBA2_GGUF, root / "hf")
    out = {}
    for qtype in ("F32", "Q8_0"):
        os.makedirs(root / qtype)
        path, held = write_mamba2_gguf(hf_dir, str(root / qtype / f"tiny-mamba2-{qtype}.gguf"), qtype)
        oracle = hf_dir
        if qtype != "F32":
            oracle = str(root / f"oracle-{qtype}")
            shutil.copytree(hf_dir, oracle)
            save_file({k: v.contiguous() for k, v in held.items()}, os.path.join(oracle, "model.safetensors"))
        out[qtype] = (path, oracle)
    return out


def test_mamba2_gguf_config_is_the_checkpoints(mamba2_files):
    ours, theirs = load_config(mamba2_files["F32"][0]), load_config(mamba2_files["F32"][1])
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim", "n_groups", "state_size",
                "conv_kernel", "use_bias", "use_conv_bias", "tie_word_embeddings"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.layer_norm_epsilon == pytest.approx(theirs.layer_norm_epsilon)  # (stored as float32)
    assert int(ours.expand * ours.hidden_size) == int(theirs.expand * theirs.hidden_size)
    assert not hasattr(ours, "max_position_embeddings") or ours.max_position_embeddings is None


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_mamba2_gguf_greedy_matches_hf(mamba2_files, qtype):
    """A tiny pure Mamba2 GGUF through the engine (chunked prefill under a 16-token budget crossing SSD chunks of 8,
    mixed batches): HF's greedy tokens on the weights the file holds; A comes back from -exp(A_log) within fp32."""
    path, oracle = mamba2_files[qtype]
    llm = _engine(path)
    assert isinstance(llm.llm_engine.model, Mamba2CausalLM)
    prompts = [[t % 320 for t in p] for p in _prompts()]
    got = run(llm, prompts, max_tokens=12)
    assert got == [hf_greedy_recompute(oracle, tuple(p), 12) for p in prompts]

