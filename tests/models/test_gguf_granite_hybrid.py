"""Granite-4.0-H GGUF (arch ``granitehybrid``, llama.cpp's ``GraniteHybridModel``) loaded natively (issue 28):
config from the metadata and the converter's tensor transforms undone (models/gguf_granite_hybrid.py).

The files are written by llama.cpp b11434's own ``convert_hf_to_gguf.py`` (the peer build of
``ci/setup_llamacpp_peer.sh``, with its gguf-py) from a tiny random ``GraniteMoeHybridForCausalLM``; where that
build is absent (CI without the peer), by :func:`write_granite_gguf`, which follows the converter's code with the
``gguf`` package, and which ``test_writer_is_the_converter`` checks against the converter (same model metadata,
tensor names, types and bytes) where both exist. Two variants, as the converter tells them apart: routed experts with
a shared expert (``ffn_*_exps`` and ``ffn_*_shexp``) and dense (Granite-4.0-H-micro: no experts, the shared MLP as
the plain ``ffn_*``, tied embeddings), both without rotary as released (the converter writes
``rope.scaling.finetuned`` false for any Granite-4.0-H, and llama.cpp then runs none), every Granite multiplier away
from 1, ``layer_types`` named "mamba" / "attention" as the released configs name them (b11434's converter finds
attention layers by that name only).

F32 and Q8_0: greedy tokens of 8 prompts of 1..37 tokens (blocks of 8, chunked prefill under a 16-token budget,
mixed batches) and the prompt log-probabilities of three of them, against HF transformers on the original
safetensors model (Q8_0: on those weights through gguf's Q8_0 / F16 round trip, for the tensors the file holds so).
Skipping the ``A = -exp(A_log)`` transform was checked by hand to fail the parity tests; skipping the q/k row
permute (harmless to a run without rotary) fails ``test_weights_are_the_checkpoints``. A file lacking a key the
config needs is refused naming it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine_parity import hf_model, run
from gguf_utils import add_placeholder_vocab, assert_same_gguf
from hf_recompute import hf_greedy_recompute
from pagedllm import LLM, SamplingParams
from pagedllm.bench.llama_cpp_bench import llama_cpp_bin
from pagedllm.models import load_config, load_model
from pagedllm.models.granite_hybrid import GraniteMoeHybridCausalLM
from pagedllm.quantization.linear import QuantizedLinear
from stateful import random_prompts
from tiny_models import save_random_model

CONVERT = llama_cpp_bin("convert_hf_to_gguf")
HAVE_CONVERTER = os.access(CONVERT, os.X_OK)
VOCAB = 304  # a multiple of 8: the converter pads a hybrid's vocabulary to one
#: Routed experts + shared expert; Mamba2 heads of 16 in 2 groups, SSD chunks of 8; widths multiples of 32 (Q8_0)
MOE = dict(model_type="granitemoehybrid", vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
           shared_intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2,
           mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8, num_local_experts=4,
           num_experts_per_tok=2, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
           logits_scaling=2.5, position_embedding_type=None, max_position_embeddings=256, initializer_range=0.15,
           bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
#: Granite-4.0-H-micro's shape: no routed experts, intermediate_size = shared_intermediate_size, tied embeddings
DENSE = dict(MOE, num_local_experts=0, intermediate_size=64, tie_word_embeddings=True,
             layer_types=["mamba", "attention", "mamba", "attention"])
VARIANTS = {"moe": MOE, "dense": DENSE}
QTYPES = ("F32", "Q8_0")
PROMPT_LENS = (1, 2, 7, 9, 16, 17, 23, 37)
#: the converter runs (~80 s on two busy cores) and the engine runs against HF
pytestmark = pytest.mark.slow
_RELEASED_NAMES = {"linear_attention": "mamba", "full_attention": "attention"}


def save_granite(config: dict, out_dir) -> str:
    """The tiny random model, its config's ``layer_types`` named as the released checkpoints name them."""
    path = save_random_model(config, out_dir)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["layer_types"] = [_RELEASED_NAMES.get(t, t) for t in cfg["layer_types"]]
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return path


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """``LlamaModel.permute`` (rows of each head: rotate_half pairs -> interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_names(c, hf_name: str) -> list[str]:
    """The GGUF tensors ``GraniteHybridModel.modify_tensors`` writes ``hf_name`` to (``input_linear``: gate, up)."""
    import gguf

    m = re.fullmatch(r"model\.layers\.(\d+)\.(block_sparse_moe|shared_mlp)\.(input|output)_linear\.weight", hf_name)
    dense = not c.num_local_experts
    if m and m[3] == "input":
        kind = "_exps" if m[2] == "block_sparse_moe" else "" if dense else "_shexp"
        return [f"blk.{m[1]}.ffn_{p}{kind}.weight" for p in ("gate", "up")]
    if m and m[2] == "shared_mlp" and dense:
        return [f"blk.{m[1]}.ffn_down.weight"]
    if hf_name.endswith(".dt_bias"):  # Mamba2Model.filter_tensors
        hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GRANITE_HYBRID, c.num_hidden_layers)
    return [names.get_name(hf_name, try_suffixes=(".weight", ".bias"))]


def _q8_0_type(name: str, data: np.ndarray):
    """The type the converter's ``--outtype q8_0`` gives a tensor: F32 for 1-D tensors, norms and the Mamba2
    A / D / conv; Q8_0 where rows split into blocks of 32, else F16."""
    import gguf

    T = gguf.GGMLQuantizationType
    if data.ndim < 2 or name.endswith(("norm.weight", ".ssm_a", ".ssm_d", "ssm_conv1d.weight", "ffn_gate_inp.weight")):
        return T.F32
    return T.Q8_0 if data.shape[-1] % 32 == 0 else T.F16


def write_granite_gguf(hf_dir: str, path: str, qtype: str = "F32", drop: tuple[str, ...] = ()) -> str:
    """The safetensors Granite-4.0-H in ``hf_dir`` as b11434's ``GraniteHybridModel`` writes it (metadata keys in
    ``drop`` left out), with a placeholder vocabulary."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    attn = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    head_dim = c.hidden_size // c.num_attention_heads
    inner = c.mamba_expand * c.hidden_size
    w = gguf.GGUFWriter(path, "granitehybrid")
    keys = {  # TextModel, GraniteModel, GraniteMoeModel, GraniteHybridModel.set_gguf_parameters
        "context_length": (w.add_context_length, 2 ** 20), "embedding_length": (w.add_embedding_length, c.hidden_size),
        "feed_forward_length": (w.add_feed_forward_length, c.intermediate_size),
        "attention.head_count": (w.add_head_count, c.num_attention_heads),
        "block_count": (w.add_block_count, c.num_hidden_layers),
        "rope.freq_base": (w.add_rope_freq_base, c.rope_parameters["rope_theta"]),
        "attention.layer_norm_rms_epsilon": (w.add_layer_norm_rms_eps, c.rms_norm_eps),
        "expert_count": (w.add_expert_count, c.num_local_experts),
        "expert_used_count": (w.add_expert_used_count, c.num_experts_per_tok),
        "vocab_size": (w.add_vocab_size, c.vocab_size), "rope.dimension_count": (w.add_rope_dimension_count, head_dim),
        "attention.scale": (w.add_attention_scale, c.attention_multiplier),
        "embedding_scale": (w.add_embedding_scale, c.embedding_multiplier),
        "residual_scale": (w.add_residual_scale, c.residual_multiplier),
        "logit_scale": (w.add_logit_scale, c.logits_scaling),
        "expert_shared_feed_forward_length": (w.add_expert_shared_feed_forward_length, c.shared_intermediate_size),
        "ssm.conv_kernel": (w.add_ssm_conv_kernel, c.mamba_d_conv), "ssm.state_size": (w.add_ssm_state_size,
                                                                                       c.mamba_d_state),
        "ssm.group_count": (w.add_ssm_group_count, c.mamba_n_groups), "ssm.inner_size": (w.add_ssm_inner_size, inner),
        "ssm.time_step_rank": (w.add_ssm_time_step_rank, c.mamba_n_heads),
        "attention.head_count_kv": (w.add_head_count_kv, [c.num_key_value_heads if i in attn else 0
                                                          for i in range(c.num_hidden_layers)]),
        "rope.scaling.finetuned": (w.add_rope_scaling_finetuned, False)}
    for key, (add, value) in keys.items():
        if key not in drop:
            add(value)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if qtype == "F32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_placeholder_vocab(w, c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    for hf_name, t in hf.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = t.numpy().astype(np.float32)
        if hf_name.endswith("self_attn.q_proj.weight"):
            data = _permute(data, c.num_attention_heads)
        elif hf_name.endswith("self_attn.k_proj.weight"):
            data = _permute(data, c.num_key_value_heads)
        elif hf_name.endswith("conv1d.weight"):
            data = data.squeeze()
        elif hf_name.endswith((".A_log", ".D")):
            data = data.reshape(*data.shape, 1)
        elif hf_name.endswith("mamba.norm.weight"):
            data = data.reshape(c.mamba_n_groups, inner // c.mamba_n_groups)
        if hf_name.endswith(".A_log"):
            data = -torch.exp(torch.from_numpy(data)).numpy()  # torch's exp, as the converter (bit for bit)
        names = gguf_names(c, hf_name)
        for name, part in zip(names, np.split(data, len(names), axis=-2) if len(names) > 1 else [data]):
            part = np.ascontiguousarray(part)
            qt = gguf.GGMLQuantizationType.F32 if qtype == "F32" else _q8_0_type(name, part)
            if qt == gguf.GGMLQuantizationType.F32:
                w.add_tensor(name, part)
            elif qt == gguf.GGMLQuantizationType.F16:
                w.add_tensor(name, part.astype(np.float16))
            else:
                w.add_tensor(name, quantize(part, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def convert(jobs: list[tuple[str, str, str]]) -> None:
    """Each ``(hf_dir, path, qtype)`` through llama.cpp's own converter (F32 or Q8_0), all at once (a run is mostly
    the converter's start-up), else through :func:`write_granite_gguf`."""
    if not HAVE_CONVERTER:
        for hf_dir, path, qtype in jobs:
            write_granite_gguf(hf_dir, path, qtype)
        return
    procs = [subprocess.Popen([CONVERT, hf_dir, "--outtype", qtype.lower(), "--outfile", path],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=dict(os.environ, PYTHON=sys.executable)) for hf_dir, path, qtype in jobs]
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, out[-3000:]


def round_trip_oracle(hf_dir: str, gguf_path: str, out_dir: str) -> str:
    """A copy of ``hf_dir`` whose tensors went through the types ``gguf_path`` holds them in (Q8_0 rows and F16 are
    row-local, so the converter's row permutes and splits commute with the round trip)."""
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from pagedllm.models.gguf_weights import read_tensors

    c = AutoConfig.from_pretrained(hf_dir)
    types = {t.name: t.tensor_type for t in read_tensors(gguf_path)[1]}
    held = {}
    for hf_name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        qts = {types[n] for n in gguf_names(c, hf_name) if n in types}
        assert len(qts) == 1, (hf_name, qts)
        qt = qts.pop()
        if qt.name not in ("F32", "F16"):
            t = torch.from_numpy(dequantize(quantize(t.numpy(), qt), qt).copy())
        elif qt.name == "F16":
            t = t.half().float()
        held[hf_name] = t.contiguous()
    shutil.copytree(hf_dir, out_dir)
    save_file(held, os.path.join(out_dir, "model.safetensors"))
    return out_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """(variant, qtype) -> (GGUF path, HF folder holding the weights the GGUF holds)."""
    root = tmp_path_factory.mktemp("gguf_granite")
    hf_dirs = {variant: save_granite(config, root / variant / "hf") for variant, config in VARIANTS.items()}
    jobs = {(v, q): (hf_dirs[v], str(root / v / f"tiny-granite-{q}.gguf"), q) for v in VARIANTS for q in QTYPES}
    convert(list(jobs.values()))
    return {(v, q): (path, hf_dir if q == "F32" else round_trip_oracle(hf_dir, path, str(root / v / "oracle")))
            for (v, q), (hf_dir, path, _) in jobs.items()}


def _engine(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=8,
               max_num_batched_tokens=16, kv_cache_memory=8 << 20, **kw)


@pytest.mark.parametrize("variant", VARIANTS)
def test_config_is_the_checkpoints(files, variant):
    """The layer kinds from the per-layer KV head counts, the Mamba2 sizes, experts, multipliers; no rotary."""
    path, hf_dir = files[variant, "F32"]
    ours, theirs = load_config(path), load_config(hf_dir)
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "layer_types", "intermediate_size", "shared_intermediate_size", "num_local_experts", "mamba_n_heads",
                "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand", "mamba_conv_bias",
                "mamba_proj_bias", "attention_bias", "tie_word_embeddings", "position_embedding_type"):
        assert getattr(ours, key) == getattr(theirs, key), key
    for key in ("rms_norm_eps", "attention_multiplier", "embedding_multiplier", "residual_multiplier",
                "logits_scaling"):
        assert getattr(ours, key) == pytest.approx(getattr(theirs, key)), key  # (stored as float32)
    if theirs.num_local_experts:
        assert ours.num_experts_per_tok == theirs.num_experts_per_tok


@pytest.mark.parametrize("variant", VARIANTS)
def test_weights_are_the_checkpoints(files, variant, ref_backend):
    """Every parameter of the model read from the F32 file equals the one read from the safetensors checkpoint
    (q/k rows, A_log, D, norm and conv shapes, the joined input_linear, the dense shared MLP)."""
    path, hf_dir = files[variant, "F32"]
    cpu = torch.device("cpu")
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=cpu).state_dict()
    theirs = load_model(hf_dir, backend=ref_backend, dtype=torch.float32, device=cpu).state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_and_logprobs_match_hf(files, variant, qtype):
    """8 prompts of 1..37 tokens under a 16-token budget (chunks continue their conv and SSM state, decodes mixed
    in): HF's greedy tokens on the weights the file holds, state slots given back; then the prompt log-probabilities
    of three prompts (the top 5 and the actual next token at every position) within 1e-4 of HF's."""
    path, oracle = files[variant, qtype]
    llm = _engine(path)
    eng = llm.llm_engine
    assert isinstance(eng.model, GraniteMoeHybridCausalLM) and eng.kv.state_slots is not None
    prompts = random_prompts(VOCAB, PROMPT_LENS)
    got = run(llm, prompts, max_tokens=12)
    assert got == [hf_greedy_recompute(oracle, tuple(p), 12) for p in prompts]
    assert eng.kv.state_slots.num_free == eng.kv.state_slots.num_slots
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[-3:]],
                        SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    hf = hf_model(oracle)
    with torch.inference_mode():
        for p, out in zip(prompts[-3:], outs):
            want = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            for i, top in enumerate(out.prompt_logprobs[1:]):
                assert p[i + 1] in top and len(top) >= 5
                got_lp = torch.tensor([lp.logprob for lp in top.values()])
                torch.testing.assert_close(got_lp, want[i, list(top)], rtol=0, atol=1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_q8_0_packed_linears_compute_the_dequantized_ones(files, variant):
    """Kept packed (``quantization="gguf"``): the Mamba2 projections, the fused q/k/v (q/k rows unpermuted on the
    blocks) and the shared MLP's ``input_linear`` (gate and up blocks joined) run on the packed kernel and compute
    what the dequantized engine's linears do, within fp32 rounding."""
    path = files[variant, "Q8_0"][0]
    packed = _engine(path, quantization="gguf").llm_engine.model
    dense = dict(_engine(path).llm_engine.model.named_modules())
    mamba, attn = packed.layers[0], packed.layers[1]
    assert all(type(m) is QuantizedLinear for m in (mamba.mamba.in_proj, mamba.mamba.out_proj,
                                                    attn.self_attn.qkv_proj, attn.shared_mlp.input_linear))
    x = torch.randn(5, MOE["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for name, m in packed.named_modules():
            if isinstance(m, QuantizedLinear) and m.in_features == x.shape[1]:
                want = dense[name](x)
                torch.testing.assert_close(m(x), want, rtol=0, atol=1e-5 * want.abs().max().item(), msg=name)


@pytest.mark.parametrize("key", ["ssm.state_size", "attention.head_count_kv", "expert_shared_feed_forward_length"])
def test_missing_key_is_refused_naming_it(files, tmp_path, key):
    """A file without a key the config needs is refused at load, naming the key (not a default guessed)."""
    path = write_granite_gguf(files["moe", "F32"][1], str(tmp_path / "bad.gguf"), drop=(key,))
    with pytest.raises(ValueError, match=re.escape(f"lacks metadata key 'granitehybrid.{key}'")):
        load_config(path)
    with pytest.raises(ValueError, match=re.escape(f"'granitehybrid.{key}'")):
        LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=64)


@pytest.mark.skipif(not HAVE_CONVERTER, reason=f"llama.cpp peer not built ({CONVERT}): run ci/setup_llamacpp_peer.sh")
@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_writer_is_the_converter(files, tmp_path, variant, qtype):
    """:func:`write_granite_gguf` (the file CI without the peer tests) writes what llama.cpp's converter writes: the
    same ``granitehybrid.*`` metadata and the same tensors (names, types, shapes, bytes)."""
    hf_dir = files[variant, "F32"][1]  # (the F32 file's oracle is the checkpoint itself)
    assert_same_gguf(write_granite_gguf(hf_dir, str(tmp_path / "ours.gguf"), qtype), files[variant, qtype][0],
                     "granitehybrid.")
