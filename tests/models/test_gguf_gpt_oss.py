"""GPT-OSS GGUF (arch ``gpt-oss``, llama.cpp's ``GptOssModel``) loaded natively (issue 28): config from the metadata
and the converter's tensor transforms undone (models/gguf_gpt_oss.py).

The files are written by llama.cpp b11434's own ``convert_hf_to_gguf.py`` (the peer build of
``ci/setup_llamacpp_peer.sh``, with its gguf-py) from a tiny random ``GptOssForCausalLM``, its vocabulary step
replaced by a placeholder vocabulary (``GptOssModel.set_vocab`` hashes a real tokenizer's pre-tokenizer, which a
random model has not); where that build is absent (CI without the peer), by :func:`write_gpt_oss_gguf`, which
follows the converter's code with the ``gguf`` package, and which ``test_writer_is_the_converter`` checks against
the converter (same ``gpt-oss.*`` metadata, tensor names, types, shapes and bytes) where both exist.

Three files: F32 and Q8_0 from the dense checkpoint, and MXFP4 from the same model with its experts stored as MXFP4
(``*_blocks`` / ``*_scales``, as gpt-oss is published), which the converter repacks to ggml's MXFP4. The model has
sinks drawn large enough to matter, YaRN over a short original context, alternating sliding (window 8) and full
layers, and experts scaled so that llama.cpp's SwiGLU clamp (7.0) bites. Greedy tokens of 8 prompts of 1..37 tokens
(blocks of 8, chunked prefill under a 16-token budget, mixed batches) and the prompt log-probabilities of three of
them, against HF transformers on the original model (Q8_0: on its weights through gguf's Q8_0 round trip, for the
tensors the file holds so; MXFP4: on its experts dequantized by transformers' own ``convert_moe_packed_tensors``).
A file lacking a key llama.cpp requires is refused naming it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from gguf_utils import add_placeholder_vocab, assert_same_gguf
from logit_parity import hf_eager
from pagedllm import LLM, SamplingParams
from pagedllm.bench.llama_cpp_bench import llama_cpp_bin
from pagedllm.models import CausalLM, load_config, load_model
from pagedllm.models.gpt_oss import GptOssMoeBlock
from stateful import random_prompts
from tiny_models import save_random_model

BUILD = os.path.dirname(os.path.dirname(llama_cpp_bin("convert_hf_to_gguf")))
CONVERT_SCRIPT = os.path.join(BUILD, "src", "convert_hf_to_gguf.py")
HAVE_CONVERTER = os.path.isfile(CONVERT_SCRIPT)
VOCAB = 304
#: widths multiples of 32 (Q8_0 and MXFP4 blocks); layer_types left to GPT-OSS's default (sliding first,
#: alternating: the only pattern the converter's files say); swiglu_limit llama.cpp's constant
CONFIG = dict(model_type="gpt_oss", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
              initializer_range=0.15, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              tie_word_embeddings=False, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
              swiglu_limit=7.0, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                 "original_max_position_embeddings": 128})
QTYPES = ("F32", "Q8_0", "MXFP4")
PROMPT_LENS = (1, 2, 7, 9, 16, 17, 23, 37)
#: the converter runs and the engine runs against HF
pytestmark = pytest.mark.slow

_FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def save_gpt_oss(out_dir) -> str:
    """The tiny random model, its sinks redrawn with std 2 and its ``gate_up_proj`` scaled by 4 (HF's init makes
    both too small to tell a model that ignores them: the sinks, or the clamp)."""
    path = save_random_model(CONFIG, out_dir)
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    g = torch.Generator().manual_seed(7)
    for key in [k for k in sd if k.endswith("self_attn.sinks")]:
        sd[key] = torch.randn(sd[key].shape, generator=g) * 2.0
    for key in [k for k in sd if k.endswith("experts.gate_up_proj")]:
        sd[key] = sd[key] * 4.0
    save_file(sd, file, metadata={"format": "pt"})
    return path


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-layout experts ``[E, in, out]`` -> the published checkpoints' ``_blocks`` ``[E, out, in/32, 16]`` (two
    e2m1 codes a byte, low nibble first) and ``_scales`` ``[E, out, in/32]`` (exponent + 127): round to nearest."""
    x = w.transpose(1, 2).unflatten(-1, (-1, 32))
    exp = torch.ceil(torch.log2(x.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = (x / torch.exp2(exp)[..., None])[..., None].sub(_FP4).abs().argmin(-1)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8), (exp + 127).to(torch.uint8)


def save_mxfp4(dense: str, out_dir: str) -> tuple[str, str]:
    """(the model with its experts stored as MXFP4 as published, a dense copy holding transformers' own
    dequantization of those experts: the oracle)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    sd = load_file(os.path.join(dense, "model.safetensors"))
    packed, oracle = dict(sd), dict(sd)
    for key in [k for k in sd if k.endswith(_EXPERTS)]:
        blocks, scales = _to_mxfp4(packed.pop(key))
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        oracle[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
    out, ref = os.path.join(out_dir, "mxfp4"), os.path.join(out_dir, "mxfp4-oracle")
    shutil.copytree(dense, ref)
    save_file(oracle, os.path.join(ref, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(out)
    save_file(packed, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dense, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out, ref


# ---- the converter's code (conversion/gpt_oss.py, base.py), with the gguf package ----

def _nibble_layout(t: torch.Tensor) -> torch.Tensor:
    """``GptOssModel.transform_nibble_layout``: HF's MXFP4 bytes -> ggml's (aaaa...bbbb... -> abab...)."""
    t = ((t & 0x0F) << 4) | ((t & 0xF0) >> 4)
    a, b = t.chunk(2, dim=-1)
    a = torch.stack(((a & 0xF0).view(-1, 1), (a << 4).view(-1, 1)), dim=2).view(t.shape)
    b = torch.stack(((b >> 4).view(-1, 1), (b & 0x0F).view(-1, 1)), dim=2).view(t.shape)
    out = a | b
    return ((out & 0xF0) >> 4) | ((out & 0x0F) << 4)


def _repack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """``GptOssModel.repack_mxfp4``: ``[E, rows, in/32, 16]`` + ``[E, rows, in/32]`` -> ggml MXFP4 rows."""
    data = torch.cat((scales.unsqueeze(-1), _nibble_layout(blocks)), dim=-1)
    return data.reshape(data.shape[0], data.shape[1], -1).numpy()


def converter_tensors(c, sd: dict[str, torch.Tensor]) -> list[tuple[str, np.ndarray, bool]]:
    """(GGUF name, data, already MXFP4) for each tensor ``GptOssModel.modify_tensors`` /
    ``generate_extra_tensors`` writes from the checkpoint ``sd``."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)
    out = []
    for name, t in sd.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?",
                         name)
        if m is None:
            name = name + ".weight" if "sinks" in name else name
            out.append((names.get_name(name, try_suffixes=(".weight", ".bias")), t.numpy(), False))
            continue
        blk, kind, suffix = f"blk.{m[1]}", m[2], m[3] or ""
        if suffix == "_blocks":
            continue
        if suffix == "_scales":
            blocks = sd[name.replace("_scales", "_blocks")]
            if kind == "down_proj":
                out.append((f"{blk}.ffn_down_exps.weight", _repack_mxfp4(blocks, t), True))
            else:
                for p, s in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
                    out.append((f"{blk}.ffn_{p}_exps.weight", _repack_mxfp4(blocks[:, s], t[:, s]), True))
        elif kind == "down_proj":
            out.append((f"{blk}.ffn_down_exps.{'bias' if suffix else 'weight'}",
                        (t if suffix else t.transpose(-1, -2)).numpy(), False))
        elif suffix == "_bias":
            out += [(f"{blk}.ffn_{p}_exps.bias", t[..., i::2].numpy(), False) for i, p in enumerate(("gate", "up"))]
        else:
            t = t.transpose(-1, -2)
            out += [(f"{blk}.ffn_{p}_exps.weight", t[:, i::2, :].numpy(), False) for i, p in enumerate(("gate", "up"))]
    return out


def _file_type(name: str, data: np.ndarray, qtype: str):
    """The type ``ModelBase.prepare_tensors`` gives a tensor under ``--outtype`` f32 / q8_0: F32 for 1-D tensors,
    norms, the router and anything not a ``.weight``; Q8_0 where rows split into blocks of 32, else F16."""
    import gguf

    T = gguf.GGMLQuantizationType
    if qtype != "Q8_0" or data.ndim <= 1 or name.endswith("_norm.weight") or ".ffn_gate_inp." in name \
            or not name.endswith(".weight"):
        return T.F32
    return T.Q8_0 if data.shape[-1] % 32 == 0 else T.F16


def write_gpt_oss_gguf(hf_dir: str, path: str, qtype: str = "F32", drop: tuple[str, ...] = (),
                       pattern=None) -> str:
    """The checkpoint in ``hf_dir`` (dense, or MXFP4 experts) as b11434's ``GptOssModel`` writes it (metadata keys
    in ``drop`` left out; ``pattern``: an ``attention.sliding_window_pattern`` the converter never writes), with a
    placeholder vocabulary. ``qtype`` "MXFP4" is the converter's ``--outtype f32`` of an MXFP4 checkpoint."""
    import gguf
    from gguf.quants import quantize
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    rope = c.rope_parameters
    w = gguf.GGUFWriter(path, "gpt-oss")
    keys = {  # TextModel.set_gguf_parameters, GptOssModel.set_gguf_parameters
        "block_count": (w.add_block_count, c.num_hidden_layers),
        "context_length": (w.add_context_length, c.max_position_embeddings),
        "embedding_length": (w.add_embedding_length, c.hidden_size),
        "feed_forward_length": (w.add_feed_forward_length, c.intermediate_size),
        "attention.head_count": (w.add_head_count, c.num_attention_heads),
        "attention.head_count_kv": (w.add_head_count_kv, c.num_key_value_heads),
        "rope.scaling.type": (w.add_rope_scaling_type, gguf.RopeScalingType.YARN),
        "rope.scaling.factor": (w.add_rope_scaling_factor, rope["factor"]),
        "rope.scaling.original_context_length": (w.add_rope_scaling_orig_ctx_len,
                                                 rope["original_max_position_embeddings"]),
        "rope.scaling.yarn_beta_fast": (w.add_rope_scaling_yarn_beta_fast, rope["beta_fast"]),
        "rope.scaling.yarn_beta_slow": (w.add_rope_scaling_yarn_beta_slow, rope["beta_slow"]),
        "rope.freq_base": (w.add_rope_freq_base, rope["rope_theta"]),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, c.rms_norm_eps),
        "expert_count": (w.add_expert_count, c.num_local_experts),
        "expert_used_count": (w.add_expert_used_count, c.num_experts_per_tok),
        "attention.key_length": (w.add_key_length, c.head_dim),
        "attention.value_length": (w.add_value_length, c.head_dim),
        "attention.sliding_window": (w.add_sliding_window, c.sliding_window),
        "expert_feed_forward_length": (w.add_expert_feed_forward_length, c.intermediate_size)}
    for key, (add, value) in keys.items():
        if key not in drop:
            add(value)
    if pattern is not None:
        w.add_sliding_window_pattern(pattern)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_placeholder_vocab(w, c.vocab_size)
    for name, data, mxfp4 in converter_tensors(c, load_file(os.path.join(hf_dir, "model.safetensors"))):
        if mxfp4:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        data = np.ascontiguousarray(data, dtype=np.float32)
        qt = _file_type(name, data, qtype)
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor(name, data)
        elif qt == gguf.GGMLQuantizationType.F16:
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, quantize(data, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


#: The converter, its vocabulary step a placeholder (the same one the writer adds).
_CONVERT_WITH_PLACEHOLDER_VOCAB = """
import runpy, sys
import gguf
from conversion.gpt_oss import GptOssModel

def set_vocab(self):
    n = self.hparams["vocab_size"]
    self.gguf_writer.add_tokenizer_model("gpt2")
    self.gguf_writer.add_tokenizer_pre("default")
    self.gguf_writer.add_token_list([f"<t{i}>" for i in range(n)])
    self.gguf_writer.add_token_types([gguf.TokenType.NORMAL] * n)

GptOssModel.set_vocab = set_vocab
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(jobs: list[tuple[str, str, str]]) -> None:
    """Each ``(hf_dir, path, qtype)`` through llama.cpp's own converter (``--outtype`` f32, q8_0; MXFP4: f32 of the
    MXFP4 checkpoint), all at once, else through :func:`write_gpt_oss_gguf`."""
    if not HAVE_CONVERTER:
        for hf_dir, path, qtype in jobs:
            write_gpt_oss_gguf(hf_dir, path, qtype)
        return
    src = os.path.dirname(CONVERT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(src, "gguf-py"), os.path.join(BUILD, "pydeps"),
                                                       src]))
    procs = [subprocess.Popen([sys.executable, "-c", _CONVERT_WITH_PLACEHOLDER_VOCAB, CONVERT_SCRIPT, hf_dir,
                               "--outtype", "q8_0" if qtype == "Q8_0" else "f32", "--outfile", path],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for hf_dir, path, qtype in jobs]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]


def q8_0_oracle(hf_dir: str, gguf_path: str, out_dir: str) -> str:
    """A copy of ``hf_dir`` whose tensors went through the types ``gguf_path`` holds them in, each in the file's
    layout (experts transposed: Q8_0 blocks run along the file's rows; gate and up are whole rows of the
    transposed ``gate_up_proj``, so its interleave commutes with the round trip)."""
    from gguf.quants import dequantize, quantize

    from pagedllm.models.gguf_weights import read_tensors

    types = {t.name: t.tensor_type for t in read_tensors(gguf_path)[1]}
    c = load_config(hf_dir)
    sd = load_file(os.path.join(hf_dir, "model.safetensors"))
    held = {}
    for hf_name, t in sd.items():
        gnames = [n for n, _, _ in converter_tensors(c, {hf_name: t})]
        qts = {types[n] for n in gnames}
        assert len(qts) == 1, (hf_name, qts)
        qt = qts.pop()
        expert = hf_name.endswith(_EXPERTS)
        if qt.name != "F32":
            x = t.transpose(1, 2) if expert else t
            x = torch.from_numpy(dequantize(quantize(x.contiguous().numpy(), qt), qt).copy())
            t = x.transpose(1, 2) if expert else x
        held[hf_name] = t.contiguous()
    shutil.copytree(hf_dir, out_dir)
    save_file(held, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """qtype -> (GGUF path, HF folder holding the weights the GGUF holds); "hf": the checkpoints."""
    root = tmp_path_factory.mktemp("gguf_gpt_oss")
    dense = save_gpt_oss(root / "hf")
    mxfp4, mxfp4_oracle = save_mxfp4(dense, str(root))
    sources = {"F32": dense, "Q8_0": dense, "MXFP4": mxfp4}
    jobs = {q: (sources[q], str(root / f"tiny-gpt-oss-{q}.gguf"), q) for q in QTYPES}
    convert(list(jobs.values()))
    out = {q: (path, dense) for q, (_, path, _) in jobs.items()}
    out["Q8_0"] = (out["Q8_0"][0], q8_0_oracle(dense, out["Q8_0"][0], str(root / "q8_0-oracle")))
    out["MXFP4"] = (out["MXFP4"][0], mxfp4_oracle)
    out["hf"] = (dense, mxfp4)
    return out


@functools.lru_cache(maxsize=None)
def hf_greedy(path: str, prompt: tuple[int, ...], n: int) -> list[int]:
    """``n`` argmax tokens after ``prompt`` from HF's eager float32 model in ``path``, recomputed each step."""
    model, ids = _hf(path), []
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(torch.tensor([list(prompt) + ids])).logits[0, -1].argmax()))
    return ids


@functools.lru_cache(maxsize=None)
def _hf(path: str):
    return hf_eager(path)


def _engine(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=8,
               max_num_batched_tokens=16, kv_cache_memory=8 << 20, **kw)


def test_config_is_the_checkpoints(files):
    """Sizes, experts, the window and which layers slide (llama.cpp's default pattern: GPT-OSS's), YaRN, biases,
    llama.cpp's SwiGLU constants."""
    ours, theirs = load_config(files["F32"][0]), load_config(files["hf"][0])
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window",
                "layer_types", "max_position_embeddings", "attention_bias", "tie_word_embeddings", "swiglu_limit",
                "swiglu_alpha", "architectures"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rms_norm_eps == pytest.approx(theirs.rms_norm_eps)
    assert {k: v for k, v in ours.rope_parameters.items()} == pytest.approx(
        {k: v for k, v in theirs.rope_parameters.items()})
    assert ours.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]


def test_sliding_window_pattern_key_is_read(files, tmp_path):
    """A file carrying ``attention.sliding_window_pattern`` (which this converter never writes) slides the layers
    it says, as llama.cpp's ``load_swa_pattern`` reads it: a bool per layer, or a period n (i % n < n - 1)."""
    hf = files["hf"][0]
    flags = load_config(write_gpt_oss_gguf(hf, str(tmp_path / "a.gguf"), pattern=[False, True, True]))
    assert flags.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    period = load_config(write_gpt_oss_gguf(hf, str(tmp_path / "b.gguf"), pattern=3))
    assert period.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]


def test_weights_are_the_checkpoints(files, ref_backend):
    """Every parameter read from the F32 file equals the one read from the safetensors checkpoint (sinks, the
    re-interleaved gate_up_proj and its bias, down_proj transposed back, router, q/k/v/o biases), and the MXFP4
    file's experts equal transformers' dequantization of the MXFP4 checkpoint, bit for bit."""
    cpu = torch.device("cpu")
    theirs = load_model(files["hf"][0], backend=ref_backend, dtype=torch.float32, device=cpu).state_dict()
    for qtype in ("F32", "MXFP4"):
        model = load_model(files[qtype][0], backend=ref_backend, dtype=torch.float32, device=cpu)
        assert isinstance(model, CausalLM) and all(isinstance(layer.mlp, GptOssMoeBlock) for layer in model.layers)
        ours = model.state_dict()
        if qtype == "MXFP4":
            theirs = load_model(files["MXFP4"][1], backend=ref_backend, dtype=torch.float32, device=cpu).state_dict()
        assert ours.keys() == theirs.keys()
        for key in theirs:
            torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=f"{qtype} {key}")


def test_the_clamp_bites(files):
    """The experts' gate and up cross llama.cpp's limit 7 on ordinary inputs: a loader that dropped the clamp, or
    took another limit, would not match HF."""
    sd = load_file(os.path.join(files["hf"][0], "model.safetensors"))
    x = torch.randn(64, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(0))
    h = x @ sd["model.layers.0.mlp.experts.gate_up_proj"][0] + sd["model.layers.0.mlp.experts.gate_up_proj_bias"][0]
    assert (h[:, ::2] > 7).any() and (h[:, 1::2].abs() > 7).any()


@pytest.mark.parametrize("qtype", QTYPES)
def test_greedy_and_logprobs_match_hf(files, qtype):
    """8 prompts of 1..37 tokens (past window 8 and several blocks of 8) under a 16-token budget, decodes mixed in:
    HF's greedy tokens on the weights the file holds; then the prompt log-probabilities of three prompts (the top 5
    and the actual next token at every position) within 1e-4 of HF's."""
    path, oracle = files[qtype]
    llm = _engine(path)
    eng = llm.llm_engine
    assert isinstance(eng.model, CausalLM) and eng.model.layer_sliding_windows == [8, None, 8]
    prompts = random_prompts(VOCAB, PROMPT_LENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(oracle, tuple(p), 12) for p in prompts]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[-3:]],
                        SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    hf = _hf(oracle)
    with torch.inference_mode():
        for p, out in zip(prompts[-3:], outs):
            want = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            for i, top in enumerate(out.prompt_logprobs[1:]):
                assert p[i + 1] in top and len(top) >= 5
                got_lp = torch.tensor([lp.logprob for lp in top.values()])
                torch.testing.assert_close(got_lp, want[i, list(top)], rtol=0, atol=1e-4)


@pytest.mark.parametrize("key", ["attention.sliding_window", "expert_feed_forward_length", "expert_count",
                                 "rope.scaling.original_context_length"])
def test_missing_key_is_refused_naming_it(files, tmp_path, key):
    """A file without a key llama.cpp requires (or YaRN without its original context) is refused at load, naming
    the key (not a default guessed)."""
    path = write_gpt_oss_gguf(files["hf"][0], str(tmp_path / "bad.gguf"), drop=(key,))
    with pytest.raises(ValueError, match=re.escape(f"lacks metadata key 'gpt-oss.{key}'")):
        load_config(path)
    with pytest.raises(ValueError, match=re.escape(f"'gpt-oss.{key}'")):
        LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64)


@pytest.mark.skipif(not HAVE_CONVERTER, reason=f"llama.cpp peer not built ({CONVERT_SCRIPT}): run "
                                               "ci/setup_llamacpp_peer.sh")
@pytest.mark.parametrize("qtype", QTYPES)
def test_writer_is_the_converter(files, tmp_path, qtype):
    """:func:`write_gpt_oss_gguf` (the file CI without the peer tests) writes what llama.cpp's converter writes: the
    same ``gpt-oss.*`` metadata and the same tensors (names, types, shapes, bytes; MXFP4 repacked alike)."""
    source = files["hf"][1] if qtype == "MXFP4" else files["hf"][0]
    assert_same_gguf(write_gpt_oss_gguf(source, str(tmp_path / "ours.gguf"), qtype), files[qtype][0], "gpt-oss.")
