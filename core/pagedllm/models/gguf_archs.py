"""HF configs for GGUF architectures transformers' GGUF config mapping does not know, built from the file's metadata.

transformers refuses these archs ("GGUF model with architecture ... is not supported yet"); gguf-py knows their
tensor names, so only the config is ours. Keys are those llama.cpp's ``convert_hf_to_gguf.py`` writes:

- ``glm4`` (GLM-4-0414, transformers' ``Glm4``): ``rope.dimension_count`` is the rotary part of the head
  (``head_dim * partial_rotary_factor``), rotary pairs interleaved (GGML's "norm" rope: no q/k permute), qkv bias
  when the file has ``attn_q.bias``, the fused ``gate_up_proj`` kept as ``ffn_up``, the post-attention/post-MLP norms
  as ``post_attention_norm`` / ``post_ffw_norm``.
- ``baichuan``: Llama with ``W_pack`` split into q/k/v (q/k rows permuted like Llama's); llama.cpp runs a 40-layer
  file as Baichuan-13B (ALiBi, no rotary) and any other depth as 7B (rotary), and so does this.
- ``chatglm`` (ChatGLM2/3 and remote-code GLM-4, llama.cpp's ``ChatGLMModel``, which also writes transformers'
  ``GlmForCausalLM`` with q/k/v apart): transformers' ``Glm``; q/k/v fused in ``attn_qkv`` (with bias) or
  separate, ``dense_h_to_4h`` / ``gate_up_proj`` (gate then up) as ``ffn_up``, nothing permuted; the converter
  writes no head size, so it comes from the ``attn_qkv`` (or ``attn_q``) rows, and ``rope.dimension_count`` is the
  rotary part (half).
- ``deepseek2`` (DeepSeek-V2/V3, llama.cpp's ``DeepseekV2Model``): MLA written as one-KV-head MQA (``key_length`` /
  ``value_length`` are the latent sizes; the per-head sizes are ``key_length_mla`` / ``value_length_mla``, or
  ``key_length`` / ``value_length`` in files from before the split ``attn_k_b`` / ``attn_v_b``). Sigmoid gating is
  DeepSeek-V3 (``exp_probs_b`` = ``e_score_correction_bias``, group-limited top-k over the top-2 sums), softmax or no
  gating key DeepSeek-V2 (group-limited greedy when ``expert_group_count`` > 1, as the source model routes). YaRN's
  ``mscale`` and ``mscale_all_dim`` are both ``yarn_log_multiplier / 0.1`` (the converter writes only the latter;
  llama.cpp's graph is HF's when the two are equal).

- ``mamba2`` (pure Mamba2, llama.cpp's ``Mamba2Model``): ``ssm.inner_size`` (d_inner = 2 x hidden, which the
  converter requires), ``ssm.time_step_rank`` (heads; head size d_inner / heads), ``ssm.group_count``,
  ``ssm.state_size``, ``ssm.conv_kernel``; conv and in/out projection biases from the tensors the file has; no
  ``max_position_embeddings`` (the converter writes an arbitrary 2^20; ``models/mamba2.py``'s default applies, as
  for HF checkpoints). Its tensor transforms are undone by ``gguf_ssm``. LFM2 (``lfm2``) needs nothing here:
  transformers' GGUF reader builds its config.
- ``qwen3next`` (Qwen3-Next, llama.cpp's ``Qwen3NextModel`` over ``Qwen2MoeModel``): the Gated DeltaNet sizes from
  ``ssm.*`` (``group_count`` key heads, ``time_step_rank`` value heads, ``state_size`` the key head size,
  ``inner_size`` the whole value width), ``full_attention_interval`` (the layer kinds), the rotary width
  ``rope.dimension_count`` (``partial_rotary_factor`` of ``attention.key_length``), the experts from ``expert_*``;
  every layer sparse (the converter writes no ``mlp_only_layers``). Its tensor transforms are undone by
  ``gguf_qwen35``.
- ``granitehybrid`` (Granite-4.0-H, llama.cpp's ``GraniteHybridModel``): config and tensor transforms in
  ``gguf_granite_hybrid``.
- ``gpt-oss`` (GPT-OSS, llama.cpp's ``GptOssModel``): config and tensor transforms in ``gguf_gpt_oss``.

Falcon goes through transformers' GGUF config, which can only say Falcon-7B's layout (multi-query, one layernorm);
``complete_falcon_config`` adds what a Falcon-40B/180B / Falcon 2 file means (llama.cpp's rule): a second layernorm
tensor (``attn_norm_2``: HF ``ln_attn``) or several KV heads make it ``new_decoder_architecture``, with
``num_ln_in_parallel_attn`` 2 or 1, the MLP width comes from ``ffn_up`` (the converter always writes 4 x hidden) and
the head is tied unless the file has ``output``.
The converter's q/k/v reorder of ``attn_qkv`` is undone by the weight reader (``gguf_weights``).

Phi-3 also goes through transformers' GGUF config, which has no rope scaling: a LongRoPE file (Phi-3-*-128k: the
converter writes ``rope_factors_long`` / ``rope_factors_short`` tensors, ``rope.scaling.original_context_length``
and ``rope.scaling.attn_factor``) gets its ``longrope`` rope parameters back from them in ``complete_phi3_config``,
and a partial rotary (``rope.dimension_count`` below the head size: Phi-4-mini) its ``partial_rotary_factor``;
without them both would be silently dropped.

StableLM goes through transformers' GGUF config, which drops the rotary width and cannot say ``qk_layernorm``;
``complete_stablelm_config`` reads them as llama.cpp does (the per-head norms' stacked rows: ``gguf_weights``).

Gemma 2 / Gemma 3 go through transformers' GGUF config too, which keeps the sliding window and head size but not
what llama.cpp's graph takes from elsewhere; ``complete_gemma_config`` applies llama.cpp's rules: Gemma 2's
``attn_logit_softcapping`` / ``final_logit_softcapping`` keys (50 / 30 when absent), the query scale
``1/sqrt(head_dim)`` except for the 27B depths (46 / 62 layers: ``1/sqrt(hidden / heads)``), and Gemma 3's linear
rope scaling (``rope.scaling.type`` / ``factor``) on the global layers only (local layers: base 10000, unscaled).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from pagedllm.models.gguf_gpt_oss import gpt_oss_config
from pagedllm.models.gguf_granite_hybrid import granite_hybrid_config
from pagedllm.models.gguf_weights import read_tensors

#: GGUF architectures whose config is built here (the rest go through transformers).
OWN_CONFIG_ARCHS = ("glm4", "baichuan", "chatglm", "deepseek2", "mamba2", "qwen3next", "granitehybrid", "gpt-oss")


def gguf_architecture(path: str) -> str:
    return read_tensors(path)[0]


@functools.lru_cache(maxsize=8)
def _metadata(path: str, size: int, mtime_ns: int) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """(scalar metadata, tensor shapes innermost first) of a file, once per file and process; string arrays (the
    vocabulary) are skipped by transformers' header reader."""
    from transformers.integrations.gguf.reader import read_gguf_metadata  # heavy: transformers


    meta, _ = read_gguf_metadata(path)
    return meta, {t.name: t.shape for t in read_tensors(path)[1]}


def _file_metadata(path: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    st = os.stat(path)
    return _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)


def _require(meta: dict, key: str, path: str) -> Any:
    if key not in meta:
        raise ValueError(f"GGUF file {path} lacks metadata key {key!r}")
    return meta[key]


def _common(path: str, arch: str) -> tuple[dict, dict[str, Any], dict[str, tuple[int, ...]]]:
    """(metadata, the Llama-like config fields every arch here shares, tensor shapes)."""
    st = os.stat(path)
    meta, shapes = _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    k = lambda key: _require(meta, f"{arch}.{key}", path)  # noqa: E731
    heads = int(k("attention.head_count"))
    fields = dict(
        vocab_size=int(shapes["token_embd.weight"][1]), hidden_size=int(k("embedding_length")),
        intermediate_size=int(k("feed_forward_length")), num_hidden_layers=int(k("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        max_position_embeddings=int(k("context_length")), rms_norm_eps=float(k("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    return meta, fields, shapes


def glm4_config(path: str) -> Any:
    from transformers import Glm4Config  # heavy: transformers

    meta, fields, shapes = _common(path, "glm4")
    head_dim = int(meta.get("glm4.attention.key_length", fields["hidden_size"] // fields["num_attention_heads"]))
    rotary = int(meta.get("glm4.rope.dimension_count", head_dim // 2))
    return Glm4Config(**fields, head_dim=head_dim, partial_rotary_factor=rotary / head_dim,
                      attention_bias="blk.0.attn_q.bias" in shapes, architectures=["Glm4ForCausalLM"])


def baichuan_config(path: str) -> Any:
    from transformers import LlamaConfig  # heavy: transformers

    _, fields, _ = _common(path, "baichuan")
    config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"])
    config.pagedllm_alibi = fields["num_hidden_layers"] == 40  # llama.cpp's LLM_TYPE_13B: ALiBi, no rotary
    config.pagedllm_source_architecture = "BaichuanForCausalLM"
    return config


def chatglm_config(path: str) -> Any:
    from transformers import GlmConfig  # heavy: transformers

    meta, fields, shapes = _common(path, "chatglm")
    heads, kv = fields["num_attention_heads"], fields["num_key_value_heads"]
    fused = "blk.0.attn_qkv.weight" in shapes  # ChatGLM2/3's query_key_value; GlmForCausalLM's q/k/v stay apart
    if not fused and "blk.0.attn_q.weight" not in shapes:
        raise ValueError(f"chatglm GGUF file {path} has neither 'blk.0.attn_qkv.weight' nor 'blk.0.attn_q.weight'")
    head_dim = (int(shapes["blk.0.attn_qkv.weight"][1]) // (heads + 2 * kv) if fused
                else int(shapes["blk.0.attn_q.weight"][1]) // heads)
    rotary = int(meta.get("chatglm.rope.dimension_count", head_dim // 2))
    config = GlmConfig(**fields, head_dim=head_dim, partial_rotary_factor=rotary / head_dim, hidden_act="silu",
                       attention_bias=f"blk.0.attn_{'qkv' if fused else 'q'}.bias" in shapes,
                       architectures=["GlmForCausalLM"])
    if fused:
        config.pagedllm_source_architecture = "ChatGLMModel"
    return config


def _deepseek2_rope(meta: dict, path: str, theta: float) -> dict[str, Any]:
    kind = meta.get("deepseek2.rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    if kind != "yarn":
        raise ValueError(f"deepseek2 GGUF file {path}: rope scaling {kind!r} is not mapped (only yarn)")
    k = lambda key: _require(meta, f"deepseek2.rope.scaling.{key}", path)  # noqa: E731
    if float(meta.get("deepseek2.rope.scaling.yarn_attn_factor", 1.0)) != 1.0:
        raise ValueError(f"deepseek2 GGUF file {path}: rope.scaling.yarn_attn_factor != 1 is not mapped")
    mscale = float(k("yarn_log_multiplier")) / 0.1
    return {"rope_type": "yarn", "rope_theta": theta, "factor": float(k("factor")),
            "original_max_position_embeddings": int(k("original_context_length")),
            "beta_fast": float(meta.get("deepseek2.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get("deepseek2.rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale, "mscale_all_dim": mscale}


def deepseek2_config(path: str) -> Any:
    from transformers import DeepseekV2Config, DeepseekV3Config  # heavy: transformers

    meta, fields, _ = _common(path, "deepseek2")
    rope_parameters = _deepseek2_rope(meta, path, fields.pop("rope_theta"))
    k = lambda key: _require(meta, f"deepseek2.{key}", path)  # noqa: E731
    opt = lambda key, default: meta.get(f"deepseek2.{key}", default)  # noqa: E731
    rope = int(k("rope.dimension_count"))
    mla = "deepseek2.attention.key_length_mla" in meta  # absent: a file from before the attn_k_b/attn_v_b split
    key_len = int(k("attention.key_length_mla" if mla else "attention.key_length"))
    value_len = int(k("attention.value_length_mla" if mla else "attention.value_length"))
    n_group = int(opt("expert_group_count", 1))
    sigmoid = int(opt("expert_gating_func", 1)) == 2  # gguf ExpertGatingFuncType: 1 softmax, 2 sigmoid
    q_lora = opt("attention.q_lora_rank", None)
    fields.update(num_key_value_heads=fields["num_attention_heads"], head_dim=rope,
                  q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(k("attention.kv_lora_rank")),
                  qk_rope_head_dim=rope, qk_nope_head_dim=key_len - rope, v_head_dim=value_len,
                  moe_intermediate_size=int(k("expert_feed_forward_length")), n_routed_experts=int(k("expert_count")),
                  num_experts_per_tok=int(k("expert_used_count")), n_shared_experts=int(k("expert_shared_count")),
                  first_k_dense_replace=int(k("leading_dense_block_count")),
                  routed_scaling_factor=float(opt("expert_weights_scale", 1.0)),
                  norm_topk_prob=bool(opt("expert_weights_norm", False)), n_group=n_group,
                  topk_group=int(opt("expert_group_used_count", 1)),
                  rope_parameters=rope_parameters)
    if sigmoid:
        return DeepseekV3Config(**fields, architectures=["DeepseekV3ForCausalLM"])
    return DeepseekV2Config(**fields, topk_method="group_limited_greedy" if n_group > 1 else "greedy",
                            architectures=["DeepseekV2ForCausalLM"])


def mamba2_config(path: str) -> Any:
    from transformers import Mamba2Config  # heavy: transformers

    st = os.stat(path)
    meta, shapes = _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    k = lambda key: _require(meta, f"mamba2.{key}", path)  # noqa: E731
    hidden, inner, heads = int(k("embedding_length")), int(k("ssm.inner_size")), int(k("ssm.time_step_rank"))
    if inner % heads:
        raise ValueError(f"mamba2 GGUF file {path}: ssm.inner_size {inner} is not a multiple of ssm.time_step_rank "
                         f"{heads}")
    return Mamba2Config(vocab_size=int(shapes["token_embd.weight"][1]), hidden_size=hidden,
                        num_hidden_layers=int(k("block_count")), num_heads=heads, head_dim=inner // heads,
                        expand=inner // hidden if inner % hidden == 0 else inner / hidden,
                        n_groups=int(meta.get("mamba2.ssm.group_count", 1)),
                        state_size=int(k("ssm.state_size")), conv_kernel=int(k("ssm.conv_kernel")),
                        layer_norm_epsilon=float(k("attention.layer_norm_rms_epsilon")),
                        use_bias="blk.0.ssm_in.bias" in shapes, use_conv_bias="blk.0.ssm_conv1d.bias" in shapes,
                        tie_word_embeddings="output.weight" not in shapes,
                        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"), architectures=["Mamba2ForCausalLM"])


def qwen3next_config(path: str) -> Any:
    from transformers import Qwen3NextConfig  # heavy: transformers

    meta, fields, shapes = _common(path, "qwen3next")
    k = lambda key: _require(meta, f"qwen3next.{key}", path)  # noqa: E731
    value_heads, head_dim = int(k("ssm.time_step_rank")), int(k("attention.key_length"))
    interval = int(k("full_attention_interval"))
    layers = fields["num_hidden_layers"] - int(meta.get("qwen3next.nextn_predict_layers", 0))
    fields.update(num_hidden_layers=layers, head_dim=head_dim,
                  layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(layers)],
                  rope_parameters=dict(rope_type="default", rope_theta=fields.pop("rope_theta"),
                                       partial_rotary_factor=int(k("rope.dimension_count")) / head_dim),
                  linear_conv_kernel_dim=int(k("ssm.conv_kernel")), linear_key_head_dim=int(k("ssm.state_size")),
                  linear_num_key_heads=int(k("ssm.group_count")), linear_num_value_heads=value_heads,
                  linear_value_head_dim=int(k("ssm.inner_size")) // value_heads,
                  num_experts=int(k("expert_count")), num_experts_per_tok=int(k("expert_used_count")),
                  moe_intermediate_size=int(k("expert_feed_forward_length")),
                  shared_expert_intermediate_size=int(k("expert_shared_feed_forward_length")),
                  decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3NextConfig(**fields, architectures=["Qwen3NextForCausalLM"])


def complete_falcon_config(path: str, config: Any) -> Any:
    """transformers' Falcon config of the GGUF at ``path`` with the new-decoder layout when the file has it."""
    st = os.stat(path)
    _, shapes = _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    two_norms = "blk.0.attn_norm_2.weight" in shapes
    kv = vars(config).get("num_key_value_heads") or 1  # head_count_kv, under the name transformers' key map gives it
    if two_norms or kv > 1:
        config.new_decoder_architecture, config.num_kv_heads = True, kv
        config.num_ln_in_parallel_attn = 2 if two_norms else 1
    if "blk.0.ffn_up.weight" in shapes:
        config.ffn_hidden_size = int(shapes["blk.0.ffn_up.weight"][1])
    config.tie_word_embeddings = "output.weight" not in shapes  # Falcon 2 (11B) unties the head
    return config


def complete_stablelm_config(path: str, config: Any) -> Any:
    """transformers' StableLM config of the GGUF at ``path`` with what its key map drops, read as llama.cpp reads it:
    the rotary width (``rope.dimension_count``, default the whole head), the rope base (10000 when absent, and
    llama.cpp's converter writes none), the per-head q/k norms (``attn_q_norm``: StableLM 2 12B) and the vocabulary
    size (the embedding's rows: the converter writes no ``vocab_size`` key)."""
    st = os.stat(path)
    meta, shapes = _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    head_dim = config.hidden_size // config.num_attention_heads
    rot = int(meta.get("stablelm.rope.dimension_count", head_dim))
    config.rope_parameters = dict(getattr(config, "rope_parameters", None) or {}, partial_rotary_factor=rot / head_dim,
                                  rope_theta=float(meta.get("stablelm.rope.freq_base", 10000.0)))
    config.qk_layernorm = "blk.0.attn_q_norm.weight" in shapes
    config.vocab_size = int(shapes["token_embd.weight"][1])
    return config


def complete_phi3_config(path: str, config: Any) -> Any:
    """transformers' Phi-3 config of the GGUF at ``path`` with the file's LongRoPE parameters, when it has them."""
    st = os.stat(path)
    meta, shapes = _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    params = dict(getattr(config, "rope_parameters", None) or {})
    head_dim = config.hidden_size // config.num_attention_heads
    rot = int(meta.get("phi3.rope.dimension_count", head_dim))
    if rot != head_dim:  # partial rotary (Phi-4-mini: 0.75), which transformers' key map also drops
        params["partial_rotary_factor"] = config.partial_rotary_factor = rot / head_dim
        config.rope_parameters = params
    if "rope_factors_long.weight" not in shapes:
        return config
    factors = {t.name: [float(x) for x in t.data] for t in read_tensors(path)[1]
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    original = int(_require(meta, "phi3.rope.scaling.original_context_length", path))
    params.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                  short_factor=_require(factors, "rope_factors_short.weight", path),
                  original_max_position_embeddings=original)
    if "phi3.rope.scaling.attn_factor" in meta:  # what llama.cpp scales by; HF derives the same from the lengths
        params["attention_factor"] = float(meta["phi3.rope.scaling.attn_factor"])
    config.rope_parameters = params
    config.original_max_position_embeddings = original
    return config


def complete_gemma_config(path: str, config: Any) -> Any:
    """transformers' Gemma 2 / Gemma 3 config of the GGUF at ``path`` with what llama.cpp's graph computes."""
    arch = "gemma2" if config.model_type == "gemma2" else "gemma3"
    st = os.stat(path)
    meta, _ = _metadata(os.path.realpath(path), st.st_size, st.st_mtime_ns)
    big = config.num_hidden_layers == {"gemma2": 46, "gemma3": 62}[arch]  # llama.cpp's 27B rule
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if big else config.head_dim
    if arch == "gemma2":
        config.attn_logit_softcapping = float(meta.get("gemma2.attn_logit_softcapping", 50.0))
        config.final_logit_softcapping = float(meta.get("gemma2.final_logit_softcapping", 30.0))
        return config
    kind = meta.get("gemma3.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise ValueError(f"GGUF file {path}: gemma3.rope.scaling.type {kind!r} is not one llama.cpp's gemma3 runs")
    params = {k: dict(v) for k, v in (getattr(config, "rope_parameters", None) or {}).items()}
    if kind == "linear":
        params["full_attention"].update(rope_type="linear",
                                        factor=float(_require(meta, "gemma3.rope.scaling.factor", path)))
    params["sliding_attention"] = {"rope_type": "default", "rope_theta": 10000.0}
    config.rope_parameters = params
    return config


def own_gguf_config(path: str, arch: str) -> Any:
    """The HF config of a GGUF file of an ``OWN_CONFIG_ARCHS`` architecture."""
    return {"glm4": glm4_config, "baichuan": baichuan_config, "chatglm": chatglm_config,
            "deepseek2": deepseek2_config, "mamba2": mamba2_config, "qwen3next": qwen3next_config,
            "granitehybrid": lambda p: granite_hybrid_config(p, *_file_metadata(p)),
            "gpt-oss": lambda p: gpt_oss_config(p, *_file_metadata(p))}[arch](path)
