"""Tiny GGUF checkpoints written with ``gguf.GGUFWriter`` from a tiny random HF model, linear weights block-quantized
by ``gguf.quants.quantize`` (llama.cpp's reference quantizers), q/k rows permuted as llama.cpp's converter does."""

from __future__ import annotations

import os
from types import SimpleNamespace

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


def add_model_header(w, c, ffn: int = None, kv_heads: int = None, rope_theta: float = 10000.0) -> None:
    """The hyper-parameters every tiny GGUF here carries, under llama.cpp's keys (norm epsilon and arch-specific
    keys are the caller's)."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(ffn if ffn is not None else c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(kv_heads if kv_heads is not None else c.num_key_value_heads)
    w.add_rope_freq_base(rope_theta)
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


def _deepseek2_header(w, c, split_kv_b: bool) -> None:
    """As llama.cpp's ``DeepseekV2Model.set_gguf_parameters`` on top of ``TextModel``'s. ``split_kv_b``: a converter
    that splits ``kv_b_proj`` (MLA as one-KV-head MQA over the latent, per-head sizes under ``*_mla``, expert groups
    and gating function written); else an older one (per-head sizes as key/value length, none of those keys)."""
    import gguf

    add_model_header(w, c, kv_heads=1 if split_kv_b else c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
    if split_kv_b:
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(qk_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_group_count(c.n_group)
        w.add_expert_group_used_count(c.topk_group)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if c.model_type == "deepseek_v3"
                                 else gguf.ExpertGatingFuncType.SOFTMAX)
    else:
        w.add_key_length(qk_head_dim)
        w.add_value_length(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _chatglm_header(w, c) -> None:
    """As llama.cpp's ``ChatGLMModel.set_gguf_parameters``: no head size, the rotary part as half of
    ``hidden / heads``, rope base ``10000 * rope_ratio``."""
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads // 2)
    w.add_add_bos_token(False)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)


def as_chatglm(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A HF Glm state dict under ChatGLM2/3's names (``transformer.`` dropped, as llama.cpp's converter does):
    q/k/v (and biases) fused into ``query_key_value``, ``gate_up_proj`` as ``dense_h_to_4h``; consumes ``hf``
    (tests/models/test_glm.py adds the prefix for the safetensors layout)."""
    import re

    out = {"embedding.word_embeddings.weight": hf.pop("model.embed_tokens.weight"),
           "encoder.final_layernorm.weight": hf.pop("model.norm.weight"),
           "output_layer.weight": hf.pop("lm_head.weight")}
    layers = {int(m[1]) for n in hf if (m := re.match(r"model\.layers\.(\d+)\.", n))}
    for i in sorted(layers):
        p, q = f"model.layers.{i}.", f"encoder.layers.{i}."
        for leaf in ("weight", "bias"):
            out[f"{q}self_attention.query_key_value.{leaf}"] = torch.cat(
                [hf.pop(f"{p}self_attn.{x}_proj.{leaf}") for x in "qkv"])
        out[f"{q}self_attention.dense.weight"] = hf.pop(f"{p}self_attn.o_proj.weight")
        out[f"{q}mlp.dense_h_to_4h.weight"] = hf.pop(f"{p}mlp.gate_up_proj.weight")
        out[f"{q}mlp.dense_4h_to_h.weight"] = hf.pop(f"{p}mlp.down_proj.weight")
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{q}{norm}.weight"] = hf.pop(f"{p}{norm}.weight")
    assert not hf, f"ChatGLM re-lay missed {sorted(hf)}"
    return out


def _split_kv_b(name: str, t: torch.Tensor, c) -> list[tuple[str, torch.Tensor]]:
    """llama.cpp's DeepseekV2Model: ``kv_b_proj`` -> ``k_b_proj`` (per head, transposed: ``[heads, kv_lora, nope]``)
    and ``v_b_proj`` (``[heads, v, kv_lora]``)."""
    kv_b = t.view(c.num_key_value_heads, c.qk_nope_head_dim + c.v_head_dim, t.shape[-1])
    k_b, v_b = torch.split(kv_b, [c.qk_nope_head_dim, c.v_head_dim], dim=1)
    return [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)), (name.replace("kv_b_proj", "v_b_proj"), v_b)]


def add_bpe_vocab(w, tokenizer_dir: str, pre: str, vocab_size: int) -> None:
    """A HF BPE tokenizer as llama.cpp's converter writes it (``TextModel._set_vocab_gpt2`` / ``get_vocab_base``):
    every id's token (``[PAD<i>]`` past the tokenizer), added tokens CONTROL when special else USER_DEFINED, merges
    and special ids by gguf-py's ``SpecialVocab``; ``pre`` is what the converter's pre-tokenizer hash names."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    reverse = {i: t for t, i in tok.get_vocab().items()}
    added, decoder = tok.get_added_vocab(), tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        tokens.append(reverse[i])
        types.append(gguf.TokenType.NORMAL if reverse[i] not in added else
                     gguf.TokenType.CONTROL if decoder[i].special else gguf.TokenType.USER_DEFINED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True).add_to_gguf(w)


def add_placeholder_vocab(w, vocab_size: int, pre: str = "default") -> None:
    """A vocab of ``<t{i}>`` placeholders (a BPE model with no merges): enough for files whose tests pass token ids
    (``skip_tokenizer_init``), written with the fields llama.cpp's loader requires."""
    import gguf

    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([f"<t{i}>" for i in range(vocab_size)])
    w.add_token_types([gguf.TokenType.NORMAL] * vocab_size)


def spm_pieces(words: list[str]) -> list[tuple[str, float, int]]:
    """A small SentencePiece ("llama") vocabulary: <unk> <s> </s>, the 256 byte-fallback tokens, then every prefix of
    each "▁word" and its letters, scored so that longer pieces win (id, token, score and type as in a real one)."""
    import gguf

    out = [("<unk>", 0.0, gguf.TokenType.UNKNOWN), ("<s>", 0.0, gguf.TokenType.CONTROL),
           ("</s>", 0.0, gguf.TokenType.CONTROL)] + [(f"<0x{b:02X}>", 0.0, gguf.TokenType.BYTE) for b in range(256)]
    seen = {t for t, _, _ in out}
    for word in words:
        for piece in ["▁" + word[:i] for i in range(len(word) + 1)] + list(word):
            if piece not in seen:
                seen.add(piece)
                out.append((piece, -100.0 / len(piece), gguf.TokenType.NORMAL))
    return out


def add_spm_vocab(w, pieces: list[tuple[str, float, int]]) -> None:
    """A SentencePiece vocabulary as llama.cpp's converter writes it (``_set_vocab_sentencepiece``): tokens, scores,
    types, the <unk> id, BOS added (the <s> / </s> ids, 1 and 2, come from the model's config)."""
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _, _ in pieces])
    w.add_token_scores([s for _, s, _ in pieces])
    w.add_token_types([k for _, _, k in pieces])
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)


def write_hf_as_gguf(hf_dir: str, path: str, arch: str, qtype: str = "F32", name: str = "tiny",
                     dequantized_dir: str | None = None, split_kv_b: bool = True,
                     tokenizer: tuple[str, str] | list | None = None, relay_chatglm: bool = True,
                     rope_theta: float = 10000.0) -> str:
    """The safetensors checkpoint in ``hf_dir`` as llama.cpp's converter lays it out in ``path``: metadata under
    ``arch``'s keys, q/k rows permuted for arch "llama" (Llama, Mistral), MoE experts stacked, the shared-expert gate
    as ``[hidden]``, a tied head left out; "chatglm" from a HF Glm checkpoint re-laid as ChatGLM2/3; "deepseek2" with
    ``kv_b_proj`` split into ``attn_k_b`` / ``attn_v_b`` (``split_kv_b``, newer converters) or kept as ``attn_kv_b``.
    Weights of 2+ dims whose rows split into ``qtype`` blocks are quantized (reference quantizers of
    ``gguf.quants``), the rest F32. ``name`` is ``general.name`` (transformers reads a "llama" file named "mistral"
    as Mistral). ``dequantized_dir``: also save the HF checkpoint with the weights the GGUF holds, dequantized (the
    oracle's; row permutes, fusing and stacking commute with row-block quantization, a split ``kv_b_proj`` is
    rebuilt from its dequantized parts). ``tokenizer``: (HF tokenizer folder, pre-tokenizer name) written by
    ``add_bpe_vocab``, or SentencePiece pieces (``spm_pieces``) written by ``add_spm_vocab``. ``relay_chatglm``
    False: a HF ``GlmForCausalLM`` checkpoint under its own names, as the converter writes that class to arch
    "chatglm" (separate q/k/v)."""
    import shutil

    import gguf
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    if arch == "deepseek2":
        _deepseek2_header(w, c, split_kv_b)
    elif arch == "chatglm":
        _chatglm_header(w, c)
    else:
        add_model_header(w, c, rope_theta=rope_theta)
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
            if getattr(c, "shared_expert_intermediate_size", None):  # Qwen2-MoE; Qwen3-MoE has no shared expert
                w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    qt = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[qt][0]
    round_trip = lambda t: torch.from_numpy(dequantize(quantize(t.numpy(), qt), qt).copy())  # noqa: E731
    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    tensors: list[tuple[str, torch.Tensor]] = []  # (HF-style name gguf-py maps, tensor) in the converter's layout
    for hf_name, t in (as_chatglm(dict(hf)) if arch == "chatglm" and relay_chatglm else _stack_experts(hf)).items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if hf_name.endswith("e_score_correction_bias"):  # the converter's rename, mapped to exp_probs_b.bias
            hf_name = hf_name.removesuffix("_bias") + ".bias"
        tensors += _split_kv_b(hf_name, t, c) if split_kv_b and hf_name.endswith("kv_b_proj.weight") else \
            [(hf_name, t)]
    quantized = lambda gname, t: (qtype != "F32" and t.ndim >= 2 and gname != "token_embd.weight"  # noqa: E731
                                  and t.shape[-1] % block == 0)
    arch_id = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch]
    names = gguf.get_tensor_name_map(arch_id, c.num_hidden_layers)
    held: dict[str, torch.Tensor] = {}  # the split kv_b parts as the file holds them, dequantized
    for hf_name, t in tensors:
        gname = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        data = t.numpy().astype(np.float32)
        if arch in PERMUTED_QK_ARCHS and gname.endswith("attn_q.weight"):
            data = _permute(data, c.num_attention_heads)
        elif arch in PERMUTED_QK_ARCHS and gname.endswith("attn_k.weight"):
            data = _permute(data, c.num_key_value_heads)
        elif gname.endswith("ffn_gate_inp_shexp.weight"):
            data = data.reshape(-1)
        if quantized(gname, data):
            w.add_tensor(gname, quantize(data, qt), raw_dtype=qt)
        else:
            w.add_tensor(gname, data)
        if gname.endswith(("attn_k_b.weight", "attn_v_b.weight")):
            held[hf_name] = round_trip(t.contiguous()) if quantized(gname, data) else t
    if dequantized_dir is not None:
        shutil.copytree(hf_dir, dequantized_dir)
        oracle = {}
        for n, t in hf.items():  # quantization runs along rows, so each HF tensor round-trips on its own
            oracle[n] = round_trip(t) if (quantized("", t) and "embed_tokens" not in n and t.ndim == 2
                                          and not n.endswith("shared_expert_gate.weight")) else t
            if split_kv_b and n.endswith("kv_b_proj.weight"):
                k_b, v_b = held[n.replace("kv_b_proj", "k_b_proj")], held[n.replace("kv_b_proj", "v_b_proj")]
                oracle[n] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(t.shape).contiguous()
        save_file(oracle, os.path.join(dequantized_dir, "model.safetensors"))
    if isinstance(tokenizer, list):
        add_spm_vocab(w, tokenizer)
    elif tokenizer is not None:
        add_bpe_vocab(w, *tokenizer, vocab_size=c.vocab_size)
    return finish(w, path)


def gguf_with_oracle(hf_dir: str, out_dir: str, family: str, arch: str, qtype: str,
                     **kwargs) -> tuple[str, str]:
    """(GGUF of ``hf_dir`` in ``qtype``, HF folder with the weights the GGUF holds: ``hf_dir`` itself for F32, else
    gguf's own quantize/dequantize round trip of it). ``kwargs``: of ``write_hf_as_gguf``."""
    oracle = os.path.join(out_dir, "dequantized") if qtype != "F32" else None
    path = write_hf_as_gguf(hf_dir, os.path.join(out_dir, f"tiny-{family}-{qtype}.gguf"), arch, qtype, name=family,
                            dequantized_dir=oracle, **kwargs)
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


def write_tied_kquant_gguf(path: str, weight_type: str) -> str:
    """A 2-layer Llama GGUF laid out as llama.cpp's Q4_K_M writes a tied model: the linears in ``weight_type`` but
    layer 0's v and down projections in Q6_K (so its q/k/v parts differ in type), the token embedding (also the LM
    head: no ``output.weight``) in Q6_K, norms F32; random valid blocks."""
    import gguf

    c = SimpleNamespace(max_position_embeddings=128, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2)
    w = gguf.GGUFWriter(path, "llama")
    add_model_header(w, c)
    w.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)

    def blocks(name: str, qtype: str, n: int, k: int) -> None:
        raw = random_blocks(qtype, n, k, rng)
        if qtype in ("Q4_K", "Q5_K"):  # centre the weights (min = scale, dmin = d * mid-q) so the model is not
            sb = raw.reshape(n, k // 256, -1)  # degenerate (all-positive weights repeat one token)
            sb[..., 8:12] = (sb[..., 8:12] & 0x0F) | (sb[..., 8:12] << 4)
            sb[..., 4:8] = sb[..., 0:4]
            d = sb[..., 0:2].copy().view(np.float16)
            sb[..., 2:4] = (d * np.float16(7.5 if qtype == "Q4_K" else 15.5)).view(np.uint8)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])

    blocks("token_embd.weight", "Q6_K", c.vocab_size, c.hidden_size)
    w.add_tensor("output_norm.weight", np.ones(c.hidden_size, np.float32))
    kv = c.hidden_size // c.num_attention_heads * c.num_key_value_heads
    for i in range(c.num_hidden_layers):
        for name, n, k in [("attn_q", 256, 256), ("attn_k", kv, 256), ("attn_v", kv, 256), ("attn_output", 256, 256),
                           ("ffn_gate", 512, 256), ("ffn_up", 512, 256), ("ffn_down", 256, 512)]:
            mixed = i == 0 and name in ("attn_v", "ffn_down")  # Q4_K_M's Q6_K v and down in some layers
            blocks(f"blk.{i}.{name}.weight", "Q6_K" if mixed else weight_type, n, k)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(c.hidden_size, np.float32))
    return finish(w, path)


def assert_same_gguf(ours: str, theirs: str, meta_prefix: str) -> None:
    """Two GGUF files hold the same ``meta_prefix``-keyed metadata and the same tensors (names, types, shapes,
    bytes): a test writer against llama.cpp's converter."""
    from gguf import GGUFReader

    a, b = GGUFReader(ours), GGUFReader(theirs)

    def meta(r):
        return {k: f.contents() for k, f in r.fields.items() if k.startswith(meta_prefix)}

    assert meta(a) == meta(b)
    assert sorted(t.name for t in a.tensors) == sorted(t.name for t in b.tensors)
    by_name = {t.name: t for t in b.tensors}
    for t in a.tensors:
        o = by_name[t.name]
        assert (t.tensor_type, list(t.shape)) == (o.tensor_type, list(o.shape)), t.name
        assert np.array_equal(np.asarray(t.data), np.asarray(o.data)), t.name
