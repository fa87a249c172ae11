"""Tiny GGUF checkpoints written with ``gguf.GGUFWriter`` from a tiny random HF model, linear weights block-quantized
by ``gguf.quants.quantize`` (llama.cpp's reference quantizers), q/k rows permuted as llama.cpp's converter does."""

from __future__ import annotations

import os

import numpy as np
import torch

from pagedllm.quantization.gguf import random_blocks
from tiny_models import make_tiny_model

#: hidden 256 and intermediate 512: multiples of 256, so every K-quant (super-blocks of 256) fits every layer.
TINY_GGUF_LLAMA = dict(hidden_size=256, intermediate_size=512, vocab_size=512)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's q/k row permute (HF rotate_half layout -> GGML's interleaved one)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


#: GGUF architectures whose converter permutes q/k rows (Llama, Mistral, Mixtral; Baichuan after splitting W_pack).
PERMUTED_QK_ARCHS = ("llama", "baichuan")


def add_model_header(w, c, ffn: int = None, kv_heads: int = None) -> None:
    """The hyper-parameters every tiny GGUF here carries, under llama.cpp's keys (norm epsilon and arch-specific
    keys are the caller's)."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(ffn if ffn is not None else c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(kv_heads if kv_heads is not None else c.num_key_value_heads)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)


def finish(w, path: str) -> str:
    """Write header, metadata and tensors of GGUFWriter ``w`` to ``path`` and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_tiny_gguf(out_dir: str | os.PathLike, qtype: str, seed: int = 0) -> str:
    """A 2-layer tiny Llama as ``<out_dir>/tiny-<qtype>.gguf``: every linear weight (and the untied lm_head) in
    ``qtype`` (K-quants, which gguf-py cannot quantize: random valid blocks), embeddings and norms in F32. Returns the
    path."""
    import gguf
    from gguf.quants import quantize
    from transformers import AutoModelForCausalLM

    hf_dir = make_tiny_model("llama", os.path.join(out_dir, "hf"), seed=seed, **TINY_GGUF_LLAMA)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    path = os.path.join(out_dir, f"tiny-{qtype}.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    add_model_header(w, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, c.num_hidden_layers)
    qt = gguf.GGMLQuantizationType[qtype]
    rng = np.random.default_rng(seed)
    for hf_name, t in model.state_dict().items():
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if name.endswith("attn_q.weight"):
            data = _permute(data, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            data = _permute(data, c.num_key_value_heads)
        if data.ndim == 2 and name != "token_embd.weight":
            raw = random_blocks(qtype, *data.shape, rng) if qtype.endswith("_K") else quantize(data, qt)
            w.add_tensor(name, raw, raw_dtype=qt)
        else:
            w.add_tensor(name, data)
    return finish(w, path)


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF per-expert tensors (``mlp.experts.J.gate_proj.weight``) stacked as llama.cpp's converter stacks them
    (``mlp.experts.gate_proj`` -> ``ffn_gate_exps``, ``[experts, out, in]``); other tensors unchanged."""
    import re

    out, experts = {}, {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            experts.setdefault(f"{m[1]}.{m[3]}.weight", {})[int(m[2])] = t
        else:
            out[name] = t
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[j] for j in sorted(by_index)])
    return out


def write_hf_as_gguf(hf_dir: str, path: str, arch: str, qtype: str = "F32", name: str = "tiny",
                     dequantized_dir: str | None = None) -> str:
    """The safetensors checkpoint in ``hf_dir`` as llama.cpp's converter lays it out in ``path``: metadata under
    ``arch``'s keys, q/k rows permuted for arch "llama" (Llama, Mistral), MoE experts stacked, the shared-expert gate
    as ``[hidden]``, a tied head left out. 2-D weights whose rows split into ``qtype`` blocks are quantized (reference
    quantizers of ``gguf.quants``), the rest F32. ``name`` is ``general.name`` (transformers reads a "llama" file
    named "mistral" as Mistral). ``dequantized_dir``: also save the HF checkpoint with each quantized weight replaced
    by its dequantized blocks (the oracle's weights; row permutes and stacking commute with row-block quantization)."""
    import shutil

    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    add_model_header(w, c)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    rotary = (getattr(c, "rope_parameters", None) or {}).get("partial_rotary_factor") or 1.0
    w.add_rope_dimension_count(int(head_dim * rotary))  # GLM-4: the rotary part of the head, as its converter
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:  # as convert_hf_to_gguf writes Mixtral (LlamaModel) and Qwen2-MoE (Qwen2MoeModel)
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    quantized = {n for n, t in hf.items() if qtype != "F32" and t.ndim == 2 and "embed_tokens" not in n
                 and not n.endswith("shared_expert_gate.weight") and t.shape[-1] % block == 0}
    if dequantized_dir is not None:
        shutil.copytree(hf_dir, dequantized_dir)
        save_file({n: torch.from_numpy(dequantize(quantize(t.numpy(), qt), qt).copy()) if n in quantized else t
                   for n, t in hf.items()}, os.path.join(dequantized_dir, "model.safetensors"))
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    stacked = _stack_experts(hf)
    for hf_name, t in stacked.items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if arch in PERMUTED_QK_ARCHS and gname.endswith("attn_q.weight"):
            data = _permute(data, c.num_attention_heads)
        elif arch in PERMUTED_QK_ARCHS and gname.endswith("attn_k.weight"):
            data = _permute(data, c.num_key_value_heads)
        elif gname.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)
        if hf_name in quantized or (".experts." in hf_name and qtype != "F32"
                                    and data.shape[-1] % block == 0):  # stacked experts
            w.add_tensor(gname, quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, data)
    return finish(w, path)


def gguf_with_oracle(hf_dir: str, out_dir: str, family: str, arch: str, qtype: str) -> tuple[str, str]:
    """(GGUF of ``hf_dir`` in ``qtype``, HF folder with the weights the GGUF holds: ``hf_dir`` itself for F32, else
    gguf's own quantize/dequantize round trip of it)."""
    oracle = os.path.join(out_dir, "dequantized") if qtype != "F32" else None
    path = write_hf_as_gguf(hf_dir, os.path.join(out_dir, f"tiny-{family}-{qtype}.gguf"), arch, qtype, name=family,
                            dequantized_dir=oracle)
    return path, oracle or hf_dir


def hf_eager(folder: str):
    """HF transformers' float32 model of ``folder`` with eager attention: the logits oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def assert_engine_greedy_matches_hf(path: str, oracle: str) -> None:
    """The GGUF at ``path`` through the engine (chunked prefill with a 16-token budget, prefix caching, a mixed
    batch of 8 prompts of lengths 1-37): greedy tokens equal HF's on ``oracle``."""
    import hf_oracle
    from model_parity import NEW_TOKENS, mixed_batch
    from pagedllm import LLM, SamplingParams

    hf = hf_eager(oracle)
    llm = LLM(path, device="cpu", dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              kv_cache_memory=16 << 20, max_num_batched_tokens=16, enable_prefix_caching=True)
    wave = mixed_batch(hf.config.vocab_size)[0]
    outs = llm.generate([{"prompt_token_ids": p} for p in wave],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    for p, o in zip(wave, outs):
        assert list(o.outputs[0].token_ids) == hf_oracle.hf_greedy(hf, p, NEW_TOKENS)
