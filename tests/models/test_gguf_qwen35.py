"""Qwen3.5 GGUF (issue 28: "GGUF variants where llama.cpp writes them and ``gguf`` reads them"), written as llama.cpp's
converter (``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel``: ``_LinearAttentionVReorderBase`` over ``Qwen3NextModel``)
writes it and loaded natively, its transforms undone by models/gguf_qwen35.py: norms stored as ``w + 1`` (all but the
gated ``ssm_norm``), ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as ``ssm_dt.bias``, the conv squeezed, and the value
heads reordered from grouped to tiled (the rows of ``attn_qkv``'s value part, the conv's, ``attn_gate``,
``ssm_alpha``/``ssm_beta``, ``ssm_a``, ``ssm_dt``; the columns of ``ssm_out``). The tiny config has 2 key heads for 4
value heads, so the reorder is no identity. Dense (``qwen35``) and MoE (``qwen35moe``: ``Qwen2MoeModel``'s stacked
``ffn_{gate,up,down}_exps``, the shared expert's gate as ``[hidden]``) alike. Qwen3-Next (``qwen3next``,
``Qwen3NextModel``): the same norm / A / dt_bias / conv transforms, no value-head reorder, its fused ``in_proj_qkvz``
split into ``attn_qkv`` and ``attn_gate``; transformers builds no config for it, pagedllm does from the metadata
(models/gguf_archs.py), and HF cannot read the file, so its Q8_0 oracle is HF on the weights the file holds (gguf's
quantize/dequantize round trip).

F32: every tensor pagedllm loads equals the safetensors model's, fp32 logits within 1e-4 of HF's on the original
checkpoint, and greedy tokens (chunked prefill under a 16-token budget, mixed batches) equal HF's. Q8_0 (linear
weights block-quantized by gguf's reference quantizer; ``ssm_out`` packed too, read dense for its column order):
greedy tokens equal those of HF transformers reading the same file (its own, independent GGUF conversion); kept packed
(``quantization="gguf"``), each packed linear (rows reordered on the blocks) equals the dequantized one.
"""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from engine_parity import hf_model, run
from gguf_utils import add_placeholder_vocab
import hf_oracle
from pagedllm import LLM, SamplingParams
from pagedllm.backend.registry import get_backend
from pagedllm.models import load_config, load_model
from pagedllm.models.qwen3_next import Qwen3NextCausalLM
from pagedllm.quantization.linear import QuantizedLinear
from stateful import QWEN3_NEXT
from tiny_models import save_random_model

VOCAB = 512  # (a multiple of the Q8_0 block, for the embedding and the head)
_MOE = ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok")
#: Qwen3.5 text with a value width of 64 (4 heads of 16: ``ssm_out``'s rows split into Q8_0 blocks) and full attention
#: every second layer (the file states only ``full_attention_interval``)
QWEN35 = {k: v for k, v in QWEN3_NEXT.items() if k not in ("mlp_only_layers", *_MOE)} | dict(
    model_type="qwen3_5_text", vocab_size=VOCAB, linear_value_head_dim=16, num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention"] * 2)
#: Qwen3.5-MoE: the same with 4 experts (top 2) and a shared expert on every layer
QWEN35_MOE = QWEN35 | {k: QWEN3_NEXT[k] for k in _MOE} | dict(model_type="qwen3_5_moe_text")
#: Qwen3-Next: the same experts, Qwen3-Next's fused projections (in_proj_qkvz, in_proj_ba), every layer sparse
QWEN3NEXT = QWEN35_MOE | dict(model_type="qwen3_next", mlp_only_layers=[])
CONFIGS = {"qwen35": QWEN35, "qwen35moe": QWEN35_MOE, "qwen3next": QWEN3NEXT}
ARCHS = {"qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe", "qwen3_next": "qwen3next"}
PROMPT_LENS = (1, 2, 7, 9, 16, 17, 23, 37)


def _reorder_v_heads(t: np.ndarray, axis: int, nk: int, per_k: int, head_dim: int) -> np.ndarray:
    """llama.cpp's ``_reorder_v_heads``: value heads grouped by key head -> tiled (ggml's broadcast order)."""
    shape = t.shape
    t = t.reshape(*shape[:axis], nk, per_k, head_dim, *shape[axis + 1:])
    return np.swapaxes(t, axis, axis + 1).reshape(shape)


def _converted(c, hf_name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """[(the name given to gguf's name map, the data)] after the converter's ``modify_tensors`` chain."""
    nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
    per_k, dv, qk = nv // nk, c.linear_value_head_dim, 2 * c.linear_key_head_dim * nk
    if "linear_attn." in hf_name and per_k > 1 and c.model_type != "qwen3_next":  # _LinearAttentionVReorderBase
        if ".in_proj_qkv." in hf_name or ".conv1d." in hf_name:
            data = data.squeeze() if ".conv1d." in hf_name else data
            data = np.concatenate([data[:qk], _reorder_v_heads(data[qk:], 0, nk, per_k, dv)])
        elif ".in_proj_z." in hf_name:
            data = _reorder_v_heads(data, 0, nk, per_k, dv)
        elif ".in_proj_a." in hf_name or ".in_proj_b." in hf_name:
            data = _reorder_v_heads(data, 0, nk, per_k, 1)
        elif hf_name.endswith((".A_log", ".dt_bias")):
            data = _reorder_v_heads(data[:, None], 0, nk, per_k, 1)[:, 0]
        elif ".out_proj." in hf_name:
            data = _reorder_v_heads(data, 1, nk, per_k, dv)
    if hf_name.endswith(".A_log"):  # Qwen3NextModel
        data = -np.exp(data)
    elif hf_name.endswith(".dt_bias"):
        hf_name = hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in hf_name:
        data = data.squeeze()
    elif hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        data = data + 1
    if "in_proj_qkvz.weight" in hf_name:  # Qwen3NextModel: [q, k, v, z] per key head -> all q, k, v; all z
        dk, vk = c.linear_key_head_dim, per_k * dv
        q, k, v, z = np.split(data.reshape(nk, -1, data.shape[-1]), [dk, 2 * dk, 2 * dk + vk], axis=1)
        stem = hf_name.removesuffix(".in_proj_qkvz.weight")
        return [(f"{stem}.in_proj_qkv.weight", np.concatenate([x.reshape(-1, data.shape[-1]) for x in (q, k, v)])),
                (f"{stem}.in_proj_z.weight", z.reshape(-1, data.shape[-1]))]
    return [(hf_name, data)]


def _quantized(gname: str, data: np.ndarray, block: int) -> bool:
    """Whether the writer block-quantizes a tensor: 2-D (or stacked) weights whose rows split into blocks, but the
    embedding and the conv."""
    return data.ndim >= 2 and gname.endswith(".weight") and data.shape[-1] % block == 0 \
        and gname != "token_embd.weight" and "ssm_conv1d" not in gname


def write_qwen35_gguf(hf_dir: str, path: str, qtype: str = "F32") -> str:
    """The safetensors Qwen3.5 in ``hf_dir`` as llama.cpp's converter writes it; 2-D linear weights whose rows split
    into ``qtype`` blocks are quantized (the embedding, norms, conv and per-head vectors stay F32)."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file

    c = AutoConfig.from_pretrained(hf_dir)
    arch = ARCHS[c.model_type]
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    experts: dict[str, dict[int, torch.Tensor]] = {}  # Qwen2MoeModel stacks them: [experts, out, in]
    for name in [n for n in hf if re.fullmatch(r".*\.experts\.\d+\.\w+\.weight", n)]:
        stem, j, proj = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name).groups()
        experts.setdefault(f"{stem}.{proj}.weight", {})[int(j)] = hf.pop(name)
    hf |= {name: torch.stack([e[j] for j in sorted(e)]) for name, e in experts.items()}
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    if arch != "qwen35moe":
        w.add_feed_forward_length(c.intermediate_size)
    if arch != "qwen35":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    rotary = int(c.head_dim * c.rope_parameters.get("partial_rotary_factor", 0.25))
    w.add_rope_dimension_count(rotary)
    if arch != "qwen3next":  # three axes (text: each reads the same position, any split does)
        w.add_rope_dimension_sections([1, 1, 1, 0])
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    interval = c.layer_types.index("full_attention") + 1
    assert c.layer_types == ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                             for i in range(c.num_hidden_layers)]
    w.add_full_attention_interval(interval)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    add_placeholder_vocab(w, c.vocab_size, "qwen35")
    names = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], c.num_hidden_layers)
    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    for hf_name, t in hf.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        for name, data in _converted(c, hf_name, t.numpy().astype(np.float32)):
            gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
            assert gname is not None, name
            if gname.endswith("ffn_gate_inp_shexp.weight"):
                data = data.reshape(-1)  # the converter's [hidden] for HF's [1, hidden]
            if qtype != "F32" and _quantized(gname, data, block):
                w.add_tensor(gname, quantize(data, qt), raw_dtype=qt)
            else:
                w.add_tensor(gname, np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _round_tripped(hf_dir: str, out_dir: str) -> str:
    """``hf_dir`` with every tensor the Q8_0 file quantizes through gguf's quantize/dequantize (blocks run along rows,
    which the converter's row splits, stacks and reorders keep whole): the weights a Q8_0 file holds, for HF."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file

    q8 = GGMLQuantizationType.Q8_0
    shutil.copytree(hf_dir, out_dir)
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    for n, t in hf.items():
        if t.ndim == 2 and not n.endswith("shared_expert_gate.weight") and _quantized(n, t.numpy(), 32) \
                and "embed_tokens" not in n:
            hf[n] = torch.from_numpy(dequantize(quantize(t.numpy(), q8), q8).copy())
    save_file(hf, os.path.join(out_dir, "model.safetensors"))
    return out_dir


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def files(request, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    hf_dir = save_random_model(CONFIGS[request.param], root / "hf")
    out = {"hf": hf_dir, "arch": request.param}
    for qtype in ("F32", "Q8_0"):
        os.makedirs(root / qtype)
        out[qtype] = write_qwen35_gguf(hf_dir, str(root / qtype / f"tiny-{request.param}-{qtype}.gguf"), qtype)
    if request.param == "qwen3next":  # transformers reads no qwen3next GGUF: HF on the weights the file holds
        out["hf-Q8_0"] = _round_tripped(hf_dir, str(root / "hf-Q8_0"))
    return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _engine(path: str, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=8,
               max_num_batched_tokens=16, kv_cache_memory=8 << 20, **kw)


def test_qwen35_gguf_tensors_are_the_checkpoints(files):
    """Every tensor loaded from the F32 file equals the safetensors model's (norm offsets and A within fp32 rounding;
    the reorders exactly), and every linear (held by the backend's dense kernel, outside the state dict) computes
    what the safetensors model's does; the config (transformers' GGUF reader; Qwen3-Next: gguf_archs) has the
    checkpoint's shape."""
    ours, theirs = load_config(files["F32"]), load_config(files["hf"])
    for key in ("hidden_size", "num_hidden_layers", "layer_types", "linear_num_key_heads", "linear_num_value_heads",
                "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim",
                "vocab_size", "tie_word_embeddings", "model_type", "architectures",
                *(["intermediate_size"] if theirs.model_type == "qwen3_5_text" else _MOE)):
        assert getattr(ours, key) == getattr(theirs, key), key
    backend = get_backend("cpu")
    ours = load_model(files["F32"], backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    theirs = load_model(files["hf"], backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    got, want = ours.state_dict(), theirs.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=2e-7, msg=name)
    by_name = dict(theirs.named_modules())
    linears = [(n, m) for n, m in ours.named_modules() if hasattr(m, "in_features") and not list(m.children())]
    assert any(n.endswith("linear_attn.out_proj") for n, _ in linears)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for name, m in linears:
            x = torch.randn(3, m.in_features, generator=g)
            torch.testing.assert_close(m(x), by_name[name](x), rtol=0, atol=1e-6, msg=name)


def test_qwen35_gguf_f32_logits_and_greedy_match_hf(files):
    """8 prompts of 1..37 tokens under a 16-token budget: HF's greedy tokens; slots given back; then
    the fp32 log-probabilities of three prompts (the top 5 and the actual next token at every position, through the
    engine) within 1e-4 of HF's on the original checkpoint."""
    llm = _engine(files["F32"])
    eng = llm.llm_engine
    assert isinstance(eng.model, Qwen3NextCausalLM) and eng.kv.state_slots is not None
    hf = hf_model(files["hf"])
    prompts = _prompts()
    got = run(llm, prompts, max_tokens=16)
    assert got == [hf_oracle.hf_greedy(hf, p, 16) for p in prompts]
    assert eng.kv.state_slots.num_free == eng.kv.state_slots.num_slots
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[-3:]],
                        SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    with torch.inference_mode():
        for p, out in zip(prompts[-3:], outs):
            want = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
            for i, top in enumerate(out.prompt_logprobs[1:]):
                assert p[i + 1] in top and len(top) >= 5
                got_lp = torch.tensor([lp.logprob for lp in top.values()])
                torch.testing.assert_close(got_lp, want[i, list(top)], rtol=0, atol=1e-4)


def test_qwen35_gguf_q8_0_matches_hf_reading_the_same_file(files):
    """Dequantized at load: HF's greedy tokens on the same file. Kept packed (``quantization="gguf"``: the value-head
    rows reordered on the blocks, ``out_proj`` read dense for its columns): every packed linear computes what the
    dequantized one does, within fp32 rounding (greedy tokens are not compared there: the packed engine runs its
    float32 LM head in bfloat16, ``dense_linears.pack_dense_linears``)."""
    path = files["Q8_0"]
    hf = hf_model(files["hf-Q8_0"]) if "hf-Q8_0" in files else AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    prompts = _prompts()
    dense = _engine(path)
    assert run(dense, prompts, max_tokens=16) == [hf_oracle.hf_greedy(hf, p, 16) for p in prompts]
    packed = _engine(path, quantization="gguf").llm_engine.model
    attn = packed.layers[0].linear_attn
    if files["arch"] == "qwen3next":  # in_proj_qkvz rebuilt from two tensors (dense), in_proj_ba as stored
        assert [type(m) is QuantizedLinear for m in (attn.in_proj_qkvz, attn.in_proj_ba, attn.out_proj)] == [
            False, True, True]
    else:
        assert [type(m) is QuantizedLinear for m in (attn.in_proj_qkv, attn.in_proj_z, attn.in_proj_a,
                                                     attn.out_proj)] == [True, True, True, False]
    by_name = dict(dense.llm_engine.model.named_modules())
    x = torch.randn(5, QWEN35["hidden_size"], generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for name, m in packed.named_modules():
            if isinstance(m, QuantizedLinear) and m.in_features == x.shape[1]:
                want = by_name[name](x)
                torch.testing.assert_close(m(x), want, rtol=0, atol=1e-6 * want.abs().max().item(), msg=name)
