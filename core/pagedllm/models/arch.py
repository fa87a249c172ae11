"""Supported architectures as data: one decoder implementation, configured by per-architecture flags."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from pagedllm.errors import UnsupportedModelError
from pagedllm.models.bert import ENCODER_ARCHITECTURES
from pagedllm.models.falcon import falcon_kv_heads
from pagedllm.models.transformers_impl import transformers_architecture


@dataclass(frozen=True)
class ArchSpec:
    """How an HF architecture differs from plain Llama. Flags are functions of the HF config."""

    qkv_bias: Callable[[Any], bool]
    o_bias: Callable[[Any], bool]
    mlp_bias: Callable[[Any], bool] = lambda c: False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before rotary
    sliding: str = "none"  # none | all (Mistral: config.sliding_window everywhere) | layer_types (Qwen2/3)
    gemma: bool = False  # Gemma 2/3: (1 + w) RMSNorm, pre/post feed-forward norms, sqrt(hidden) embedding scale
    # none | experts (Mixtral, Qwen3-MoE: routed experts only) | shared (Qwen2-MoE: plus a sigmoid-gated shared expert)
    # | deepseek (grouped top-k routing, shared experts, first_k_dense_replace dense layers)
    moe: str = "none"  # ... | gpt_oss (biased router and experts, clamped SwiGLU: models/gpt_oss.py)
    sinks: bool = False  # GPT-OSS: a learned per-head sink logit (self_attn.sinks) in every softmax
    attention: str = "mha"  # mha | mla (DeepSeek: compressed latent cached, models/mla.py)
    rope_interleaved: bool = False  # GLM: rotary over (x0, x1), (x2, x3)... pairs of the rotary dims
    glm4_norms: bool = False  # Glm4: post_self_attn_layernorm and post_mlp_layernorm around the sub-blocks
    # decoder (causal_lm.CausalLM) | falcon (models/falcon.py: its own layout and norms) | stablelm (models/stablelm.py)
    # | bert (models/bert.py: encoder-only BERT / RoBERTa / XLM-R) | lfm2 (models/lfm2.py: short convs + attention)
    # | llava (models/llava.py: CLIP tower + projector + the decoder of its text_config)
    # | idefics3 (models/idefics3.py: SigLIP tower + pixel-shuffle connector + the decoder of its text_config)
    # | qwen2_vl (models/qwen2_vl.py: ViT + Qwen2 decoder with M-RoPE)
    # | gemma3_mm (models/gemma3_mm.py: SigLIP tower + pooling projector + Gemma 3 decoder, bidirectional images)
    # | qwen3_next (models/qwen3_next.py: Gated DeltaNet + gated attention + MoE)
    # | mamba2 (models/mamba2.py: pure Mamba2) | granite_hybrid (models/granite_hybrid.py: Mamba2 + attention + MoE)
    module: str = "decoder"


def hidden_act(config: Any) -> str:
    """The MLP activation: ``hidden_activation`` (Gemma) or ``hidden_act``."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def _attention_bias(c: Any) -> bool:
    return bool(getattr(c, "attention_bias", False))


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(_attention_bias, _attention_bias,
                                 mlp_bias=lambda c: bool(getattr(c, "mlp_bias", False))),
    "MistralForCausalLM": ArchSpec(lambda c: False, lambda c: False,
                                   sliding="all"),
    "Qwen2ForCausalLM": ArchSpec(lambda c: True, lambda c: False,
                                 sliding="layer_types"),
    "Qwen3ForCausalLM": ArchSpec(_attention_bias, _attention_bias, qk_norm=True,
                                 sliding="layer_types"),
    "Phi3ForCausalLM": ArchSpec(lambda c: False, lambda c: False, sliding="all"),
    "Gemma2ForCausalLM": ArchSpec(_attention_bias, _attention_bias, sliding="layer_types", gemma=True),
    "Gemma3ForCausalLM": ArchSpec(_attention_bias, _attention_bias, qk_norm=True, sliding="layer_types", gemma=True),
    "MixtralForCausalLM": ArchSpec(lambda c: False, lambda c: False, sliding="all", moe="experts"),
    "Qwen2MoeForCausalLM": ArchSpec(lambda c: bool(getattr(c, "qkv_bias", True)), lambda c: False,
                                    sliding="layer_types", moe="shared"),
    "Qwen3MoeForCausalLM": ArchSpec(_attention_bias, _attention_bias, qk_norm=True, sliding="layer_types",
                                    moe="experts"),
    "DeepseekV2ForCausalLM": ArchSpec(lambda c: False, lambda c: False, moe="deepseek", attention="mla"),
    "DeepseekV3ForCausalLM": ArchSpec(lambda c: False, lambda c: False, moe="deepseek", attention="mla"),
    "GlmForCausalLM": ArchSpec(_attention_bias, lambda c: False, rope_interleaved=True),
    "Glm4ForCausalLM": ArchSpec(_attention_bias, lambda c: False, rope_interleaved=True, glm4_norms=True),
    "GptOssForCausalLM": ArchSpec(_attention_bias, _attention_bias, sliding="layer_types", moe="gpt_oss",
                                  sinks=True),
    "FalconForCausalLM": ArchSpec(lambda c: bool(c.bias), lambda c: bool(c.bias), module="falcon"),
    "StableLmForCausalLM": ArchSpec(lambda c: bool(c.use_qkv_bias), lambda c: False, module="stablelm"),
    "Lfm2ForCausalLM": ArchSpec(lambda c: False, lambda c: False, qk_norm=True, module="lfm2"),
    "Qwen3NextForCausalLM": ArchSpec(_attention_bias, _attention_bias, qk_norm=True, moe="shared",
                                     module="qwen3_next"),
    "Qwen3_5ForCausalLM": ArchSpec(_attention_bias, _attention_bias, qk_norm=True, module="qwen3_next"),
    "Qwen3_5MoeForCausalLM": ArchSpec(_attention_bias, _attention_bias, qk_norm=True, moe="shared",
                                      module="qwen3_next"),
    "Mamba2ForCausalLM": ArchSpec(lambda c: False, lambda c: False, module="mamba2"),
    "GraniteMoeHybridForCausalLM": ArchSpec(_attention_bias, _attention_bias, module="granite_hybrid"),
}
# Pooling architectures (docs/pooling.md): the same decoder with a classification head (``score``) or none (the
# base ``*Model``, an embedding checkpoint); models/sequence_classification.py adds the head.
POOLING_ARCHITECTURES: dict[str, str] = {
    "LlamaForSequenceClassification": "LlamaForCausalLM", "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM", "MistralForSequenceClassification": "MistralForCausalLM",
    "LlamaModel": "LlamaForCausalLM", "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM",
    "MistralModel": "MistralForCausalLM",
}
# GGUF configs carry a model_type but no `architectures`.
_BY_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM",
                  "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "gemma2": "Gemma2ForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                  "falcon": "FalconForCausalLM", "glm": "GlmForCausalLM", "glm4": "Glm4ForCausalLM",
                  "stablelm": "StableLmForCausalLM", "gpt_oss": "GptOssForCausalLM"}
# Encoder-only (models/bert.py): bidirectional attention, no KV cache, the pooling runner only.
ARCHITECTURES.update({name: ArchSpec(lambda c: True, lambda c: True, module="bert")
                      for name in ENCODER_ARCHITECTURES})
# Vision-language (models/llava.py): the flags of its decoder come from its text_config.
ARCHITECTURES["LlavaForConditionalGeneration"] = ArchSpec(lambda c: False, lambda c: False, module="llava")
# Idefics3 / SmolVLM (models/idefics3.py): SigLIP tower + pixel-shuffle connector + the decoder of its text_config.
ARCHITECTURES.update({name: ArchSpec(lambda c: False, lambda c: False, module="idefics3")
                      for name in ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")})
# models/qwen2_vl.py: its ViT and the Qwen2 decoder of its text_config with M-RoPE.
ARCHITECTURES["Qwen2VLForConditionalGeneration"] = ArchSpec(lambda c: True, lambda c: False, module="qwen2_vl")
ARCHITECTURES["Qwen2_5_VLForConditionalGeneration"] = ArchSpec(lambda c: True, lambda c: False, module="qwen2_vl")
# models/gemma3_mm.py: SigLIP tower + pooling projector + the Gemma 3 decoder of its text_config.
ARCHITECTURES["Gemma3ForConditionalGeneration"] = ArchSpec(lambda c: False, lambda c: False, module="gemma3_mm")


def architecture_of(config: Any) -> tuple[str, ArchSpec]:
    """The (name, spec) of a HF config; a clear ValueError for anything we do not implement."""
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[config.model_type]]
    for name in archs:
        if name in ARCHITECTURES:
            return name, ARCHITECTURES[name]
        if name in POOLING_ARCHITECTURES:
            return name, ARCHITECTURES[POOLING_ARCHITECTURES[name]]
    shown = archs or [f"model_type={getattr(config, 'model_type', None)!r}"]
    raise UnsupportedModelError(f"unsupported model architecture {', '.join(shown)}; "
                     f"pagedllm supports {', '.join(ARCHITECTURES)}")


MODEL_IMPLS = ("auto", "native", "transformers")
#: The (empty) paged KV group's head size of a model without attention layers (pure Mamba2): one every backend takes.
EMPTY_KV_HEAD_SIZE = 64


def resolve_model_impl(config: Any, model_impl: str = "auto") -> tuple[str, str]:
    """``(architecture, "native" | "transformers")`` for ``--model-impl`` (vLLM's flag): ``auto`` prefers our native
    decoder and falls back to transformers' module with our paged attention; an error names the architecture and
    what is supported when neither can run it."""
    if model_impl not in MODEL_IMPLS:
        raise UnsupportedModelError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {model_impl!r}")
    if model_impl == "native":
        return architecture_of(config)[0], "native"
    if model_impl == "auto":
        try:
            return architecture_of(config)[0], "native"
        except UnsupportedModelError as native_error:
            try:
                return transformers_architecture(config), "transformers"
            except UnsupportedModelError as e:
                raise UnsupportedModelError(f"{native_error}; the transformers fallback cannot run it either: {e}") \
                    from None
    return transformers_architecture(config), "transformers"


def kv_cache_shape(config: Any, spec: ArchSpec) -> tuple[int, int, bool]:
    """``(num_kv_heads, head_size, mla)`` of one token's cache entry: MLA caches one latent row of ``kv_lora_rank
    + qk_rope_head_dim``, others a key and a value per KV head."""
    if spec.attention == "mla":
        return 1, config.kv_lora_rank + config.qk_rope_head_dim, True
    if spec.module == "mamba2":  # no attention layer: an empty KV group (models/mamba2.py)
        return 1, EMPTY_KV_HEAD_SIZE, False
    heads = config.num_attention_heads
    if spec.module == "falcon":
        return falcon_kv_heads(config), config.hidden_size // heads, False
    return (getattr(config, "num_key_value_heads", None) or heads,
            getattr(config, "head_dim", None) or config.hidden_size // heads, False)


def layer_sliding_windows(config: Any, spec: ArchSpec) -> list[Optional[int]]:
    """Per-layer sliding window (``None`` = full attention), exactly as HF's attention modules pick it."""
    n = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if spec.sliding == "all":
        return [window] * n
    if spec.sliding == "layer_types" and window is not None:
        types = getattr(config, "layer_types", None) or ["full_attention"] * n
        return [window if t == "sliding_attention" else None for t in types]
    return [None] * n
