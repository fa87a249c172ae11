"""Tiny random HF models (config + safetensors, float32, seeded): exact oracles with no downloads.

Weights are drawn wider than HF's default init, and norm weights and biases are randomized too (HF inits them to
ones/zeros), so logits are well separated and a wrong mapping of any tensor shows up in the outputs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

_COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               initializer_range=0.15, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# Each arch exercises its distinctive feature: GQA head_dim 64 untied (llama); sliding window smaller than the
# test prompts (mistral); qkv bias (qwen2); q/k norm with explicit head_dim 128 and tied embeddings (qwen3).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False, rope_theta=10000.0),
    "mistral": dict(model_type="mistral", sliding_window=8, tie_word_embeddings=False, head_dim=64),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", head_dim=128, tie_word_embeddings=True, hidden_size=128,
                  intermediate_size=384),
}

# The models the test suite builds: name -> (arch, overrides). "qwen2_swa" mixes full attention (layer 0) and
# sliding-window attention (layer 1).
TINY_MODEL_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_swa": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "qwen3": ("qwen3", {}),
    # A scaled rope type: inv_freq comes from HF's ROPE_INIT_FUNCTIONS rather than the default formula.
    "llama_rope_llama3": ("llama", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}

# Families pagedllm has no native decoder for: they run through the transformers fallback. Odd shapes on purpose:
# head size 48 (not a power of two), GQA 5:1, vocab 500 (not a multiple of 64), sliding window 8 (shorter than the
# test prompts).
_ODD = dict(vocab_size=500, hidden_size=240, intermediate_size=320, num_hidden_layers=2, num_attention_heads=10,
            num_key_value_heads=2, head_dim=48, max_position_embeddings=512, initializer_range=0.15,
            rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
FALLBACK_CONFIGS: dict[str, dict[str, Any]] = {
    # Phi-3: fused qkv_proj / gate_up_proj, sliding window on every layer, head_dim = hidden / heads (48).
    "phi3": dict(_ODD, model_type="phi3", hidden_size=480, sliding_window=8, head_dim=None),
    # Gemma 2: attention and final-logit soft-capping, alternating sliding/global layers, query_pre_attn_scalar,
    # (1 + w) RMSNorm, GeGLU with tanh gelu, embedding scaling, pre/post feed-forward norms.
    "gemma2": dict(_ODD, model_type="gemma2", sliding_window=8, query_pre_attn_scalar=40,
                   attn_logit_softcapping=30.0, final_logit_softcapping=20.0, tie_word_embeddings=True),
    # GLM: partial rotary (half the head), interleaved rotary pairs (native too: forced through the fallback here).
    "glm": dict(_ODD, model_type="glm", partial_rotary_factor=0.5),
    # OLMo 2: q/k RMSNorm over the whole projection, norms after attention and MLP (no native decoder).
    "olmo2": dict(_ODD, model_type="olmo2"),
    # Starcoder2: LayerNorm, biases everywhere, plain gelu MLP, sliding window 8.
    "starcoder2": dict(_ODD, model_type="starcoder2", head_dim=None, hidden_size=480, sliding_window=8, use_bias=True,
                       norm_epsilon=1e-5),
}


# Gemma 3 text: q/k (1 + w) norms, sliding layers with their own rotary base (local 10000 vs global 1e6 with
# linear scaling), 5 sliding : 1 global over 6 layers -- here pattern 2 over 3 layers.
GEMMA3 = dict(_ODD, model_type="gemma3_text", num_hidden_layers=3, sliding_window=8, query_pre_attn_scalar=40,
              sliding_window_pattern=2, tie_word_embeddings=True, rope_parameters={
                  "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})

# Yi: a Llama checkpoint (LlamaForCausalLM) with Yi's traits -- deep GQA (5:1 here), rope_theta 5e6, eps 1e-5.
YI = dict(_ODD, model_type="llama", rope_theta=5000000.0, rms_norm_eps=1e-5)

# Phi-3 with LongRoPE (short/long factors over a 0.75 partial rotary: 18 frequencies of head 48), original context
# 64 tokens: the engine uses short factors up to max_model_len 64, long ones beyond.
_FACTORS = [1.0 + 0.15 * i for i in range(18)]
PHI3_LONGROPE = dict(FALLBACK_CONFIGS["phi3"], partial_rotary_factor=0.75, original_max_position_embeddings=64,
                     rope_parameters={
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.02 * i for i in range(18)],
    "long_factor": _FACTORS, "original_max_position_embeddings": 64, "partial_rotary_factor": 0.75})

# Native MoE families, same odd shapes. Mixtral: every layer sparse, top-2 of 5 renormalised, sliding window 8.
# Qwen2-MoE: layer 1 dense (mlp_only_layers), top-3 of 6 NOT renormalised (HF's default norm_topk_prob=False), a
# sigmoid-gated shared expert, qkv bias; "qwen2_moe_norm" renormalises and makes only every 2nd layer sparse.
MOE_CONFIGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(_ODD, model_type="mixtral", intermediate_size=96, num_local_experts=5, num_experts_per_tok=2,
                    sliding_window=8),
    "qwen2_moe": dict(_ODD, model_type="qwen2_moe", num_hidden_layers=3, intermediate_size=160, num_experts=6,
                      num_experts_per_tok=3, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                      mlp_only_layers=[1], norm_topk_prob=False),
    "qwen2_moe_norm": dict(_ODD, model_type="qwen2_moe", num_hidden_layers=3, intermediate_size=160, num_experts=6,
                           num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=96,
                           decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=True),
    # Qwen3-MoE (Qwen3-30B-A3B's layout): q/k RMSNorm, routed experts only (no shared expert), a dense layer by
    # mlp_only_layers, renormalised top-k.
    "qwen3_moe": dict(_ODD, model_type="qwen3_moe", num_hidden_layers=3, intermediate_size=160, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[1], norm_topk_prob=True),
}


# DeepSeek MLA: latent 40 + rope 16 per token (not 10 heads x (24 + 16) keys + 20 values), 8 experts in 4 groups,
# layer 0 dense (first_k_dense_replace). V2: no q LoRA, softmax group-limited top-3 of the best 2 groups, scaled 1.5.
# V3: q LoRA rank 48, sigmoid scores + a random e_score_correction_bias, norm_topk_prob, YaRN rope (factor 4 over 128
# positions, mscale_all_dim: the softmax scale changes too).
_DEEPSEEK = dict(_ODD, num_hidden_layers=3, num_key_value_heads=10, head_dim=None, intermediate_size=160,
                 moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=1.5, kv_lora_rank=40,
                 qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20)
DEEPSEEK_CONFIGS: dict[str, dict[str, Any]] = {
    "deepseek_v2": dict(_DEEPSEEK, model_type="deepseek_v2", q_lora_rank=None, topk_method="group_limited_greedy"),
    "deepseek_v3": dict(_DEEPSEEK, model_type="deepseek_v3", q_lora_rank=48, norm_topk_prob=True,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                         "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}),
    "deepseek_v3_plain_rope": dict(_DEEPSEEK, model_type="deepseek_v3", q_lora_rank=48, norm_topk_prob=False,
                                   rope_interleave=False, n_shared_experts=2),
}


# Falcon, each attention layout (odd shapes: head 48, vocab 500): new_decoder_architecture with GQA 5:1 and two
# layernorms (Falcon-40B/180B), multi_query with parallel attention and tied embeddings (Falcon-7B), and the
# per-head interleaved layout with sequential attention/MLP, biases and an untied head.
_FALCON = dict(vocab_size=500, hidden_size=480, num_hidden_layers=2, num_attention_heads=10, ffn_hidden_size=320,
               max_position_embeddings=512, initializer_range=0.15, layer_norm_epsilon=1e-5, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, model_type="falcon", alibi=False)
FALCON_CONFIGS: dict[str, dict[str, Any]] = {
    "falcon_new_arch": dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True,
                            tie_word_embeddings=False),
    "falcon_mqa": dict(_FALCON, multi_query=True, parallel_attn=True, tie_word_embeddings=True),
    "falcon_sequential": dict(_FALCON, multi_query=False, parallel_attn=False, bias=True, tie_word_embeddings=False),
}


# GLM natively: partial rotary (half of head 48) over interleaved pairs, qkv bias, fused gate_up_proj in the
# checkpoint; Glm4 adds post_self_attn_layernorm / post_mlp_layernorm and a 0.75 partial rotary.
GLM_CONFIGS: dict[str, dict[str, Any]] = {
    "glm": FALLBACK_CONFIGS["glm"],
    "glm4": dict(_ODD, model_type="glm4", partial_rotary_factor=0.75, attention_bias=True),
}


def make_fallback_model(name: str, out_dir: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """A tiny random model of ``FALLBACK_CONFIGS``, ``MOE_CONFIGS``, ``DEEPSEEK_CONFIGS`` or ``FALCON_CONFIGS`` by
    name; returns the path."""
    configs = {**FALLBACK_CONFIGS, **MOE_CONFIGS, **DEEPSEEK_CONFIGS, **FALCON_CONFIGS, **GLM_CONFIGS,
               "phi3_longrope": PHI3_LONGROPE,
               "gemma3": GEMMA3, "yi": YI}
    kwargs = {k: v for k, v in {**configs[name], **overrides}.items() if v is not None}
    return save_random_model(kwargs, out_dir, seed)


BENCH_LLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=256, intermediate_size=1024,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                   tie_word_embeddings=False, initializer_range=0.1, rms_norm_eps=1e-6, bos_token_id=1,
                   eos_token_id=2, pad_token_id=0)


def _randomize_norms_and_biases(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():  # DeepSeek-V3's router bias (HF inits it to zeros)
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def save_random_model(config_kwargs: dict[str, Any], out_dir: str | os.PathLike, seed: int = 0) -> str:
    """Save a seeded random ``AutoModelForCausalLM.from_config`` model (float32) to ``out_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(config_kwargs)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize_norms_and_biases(model, torch.Generator().manual_seed(seed + 1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    return str(out)


def make_tiny_model(arch: str, out_dir: str | os.PathLike, seed: int = 0, **overrides: Any) -> str:
    """A tiny random ``arch`` model ("llama", "mistral", "qwen2", "qwen3") saved in ``out_dir``; returns the path."""
    if arch not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny arch {arch!r}; known: {sorted(TINY_CONFIGS)}")
    return save_random_model({**_COMMON, **TINY_CONFIGS[arch], **overrides}, out_dir, seed)


def make_bench_llama(out_dir: str | os.PathLike, seed: int = 0) -> str:
    """DESIGN.md's benchmark model: ~19M-parameter Llama (hidden 256, 4 layers, 8/4 heads, vocab 32000)."""
    return save_random_model(BENCH_LLAMA, out_dir, seed)


# DP+EP benchmark MoE (docs/distributed.md): Mixtral layout, experts ~80% of the weights (16 x 4 layers x 3 MiB fp32)
# so that splitting them over replicas shows in memory; SmolLM2's vocabulary so a server can load its tokenizer.
BENCH_MIXTRAL = dict(model_type="mixtral", vocab_size=49152, hidden_size=256, intermediate_size=1024,
                     num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, num_local_experts=16,
                     num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.1, rms_norm_eps=1e-6,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True)


def make_bench_mixtral(out_dir: str | os.PathLike, tokenizer_dir: str | os.PathLike, seed: int = 0) -> str:
    """:data:`BENCH_MIXTRAL` with the tokenizer files of ``tokenizer_dir`` (e.g. ``server_utils.tiny_chat_model()``)
    copied in; returns the path."""
    import shutil

    path = save_random_model(BENCH_MIXTRAL, out_dir, seed)
    for f in os.listdir(tokenizer_dir):
        if f.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path

