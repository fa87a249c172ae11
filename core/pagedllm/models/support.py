"""The supported-model table of ``docs/models.md``, generated from the code (``pagedllm models --markdown``; plain
``pagedllm models`` prints the same rows for a terminal).

Native rows come from ``ARCHITECTURES``; the GGUF column from transformers' GGUF support (it reads the config and
tokenizer; ``GGUFWeights`` reads the tensors through gguf's name map); the fallback rows from transformers' causal-LM
registry filtered as ``transformers_architecture`` filters it.
"""

from __future__ import annotations

import re
from typing import Any

from pagedllm.models.arch import ARCHITECTURES, POOLING_ARCHITECTURES, _BY_MODEL_TYPE
from pagedllm.models.bert import ENCODER_ARCHITECTURES
from pagedllm.models.remote_layouts import REMOTE_LAYOUTS

#: Families whose oracle tests (HF logits 1e-4 + engine greedy parity) run in this repository, and where.
VERIFIED: dict[str, str] = {
    "LlamaForCausalLM": "tests/models/test_models.py, tests/core/test_engine_parity.py, test_smollm2.py (GGUF); "
                        "Yi in test_native_families.py",
    "MistralForCausalLM": "tests/models/test_models.py, tests/core/test_engine_parity.py; GGUF: "
                          "test_gguf_qwen_mistral.py",
    "Qwen2ForCausalLM": "tests/models/test_models.py, tests/core/test_engine_parity.py; GGUF: "
                        "test_gguf_qwen_mistral.py",
    "Qwen3ForCausalLM": "tests/models/test_models.py, tests/core/test_engine_parity.py; GGUF: "
                        "test_gguf_qwen_mistral.py",
    "Phi3ForCausalLM": "tests/models/test_native_families.py",
    "Gemma2ForCausalLM": "tests/models/test_native_families.py",
    "Gemma3ForCausalLM": "tests/models/test_native_families.py",
    "MixtralForCausalLM": "tests/models/test_moe.py; GGUF: test_gguf_qwen_mistral.py",
    "Qwen2MoeForCausalLM": "tests/models/test_moe.py; GGUF: test_gguf_qwen_mistral.py",
    "Qwen3MoeForCausalLM": "tests/models/test_moe.py (routing vs HF); GGUF: test_gguf_qwen_mistral.py",
    "GptOssForCausalLM": "tests/models/test_gpt_oss.py (sinks, alternating windows, YaRN, clamped SwiGLU experts vs "
                         "HF); sinks vs HF's eager formula: tests/core/test_attention_sinks.py; GGUF: "
                         "test_gguf_gpt_oss.py",
    "DeepseekV2ForCausalLM": "tests/models/test_deepseek_mla.py (routing vs HF, latent KV asserted from the "
                             "allocator); GGUF: test_gguf_glm_baichuan_deepseek.py",
    "DeepseekV3ForCausalLM": "tests/models/test_deepseek_mla.py (routing vs HF, latent KV asserted from the "
                             "allocator); GGUF: test_gguf_glm_baichuan_deepseek.py",
    "FalconForCausalLM": "tests/models/test_falcon.py (grouped, multi-query and per-head layouts; ALiBi)",
    "StableLmForCausalLM": "tests/models/test_stablelm.py (parallel residual on/off, q/k LayerNorm on/off, qkv bias, "
                           "rotary 0/0.25/0.5/1; GGUF too)",
    "BaiChuanForCausalLM": "tests/models/test_remote_layouts.py (vs HF Llama on the same weights)",
    "BaichuanForCausalLM": "13B ALiBi layout: tests/models/test_remote_layouts.py (vs HF Llama, rotary removed, "
                           "torch-ops ALiBi attention); 7B mapping shared with the row above; NormHead unit-tested",
    "GlmForCausalLM": "tests/models/test_glm.py (transformers path: test_transformers_fallback.py)",
    "Glm4ForCausalLM": "tests/models/test_glm.py; GGUF: test_gguf_glm_baichuan_deepseek.py",
    "ChatGLMModel": "tests/models/test_glm.py (vs HF Glm on the same weights; every tensor name mapped); GGUF: "
                    "test_gguf_glm_baichuan_deepseek.py",
    "Lfm2ForCausalLM": "tests/models/test_lfm2.py (logits vs HF through the state slots, chunked prefill, "
                       "preemption, n=2 seeded, abort mid-prefill); conv ops: tests/core/test_state_slots.py; "
                       "cpu-static: tests/plugins/cpu/test_static_state.py; GGUF: test_gguf_hybrid.py",
    "Qwen3NextForCausalLM": "tests/models/test_qwen3_next.py (logits vs HF through the state slots, chunked "
                            "prefill, mixed batches, preemption, n=2 seeded, abort mid-prefill); delta-rule ops: "
                            "tests/core/test_delta_rule_ops.py; cpu-static: tests/plugins/cpu/test_static_state.py; "
                            "GGUF: test_gguf_qwen35.py",
    **dict.fromkeys(("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
                    "tests/models/test_qwen3_next.py (logits vs HF through the state slots, full and chunked "
                    "prefill; engine paths shared with Qwen3-Next); GGUF: test_gguf_qwen35.py"),
    "Mamba2ForCausalLM": "tests/models/test_mamba2.py (logits vs HF through the state slots, chunked prefill across "
                         "SSD chunks, preemption, abort mid-prefill, a scan that drops the state caught); "
                         "cpu-static: tests/plugins/cpu/test_static_state.py; GGUF: test_gguf_hybrid.py",
    "GraniteMoeHybridForCausalLM": "tests/models/test_mamba2.py (every multiplier away from 1; logits vs HF, chunked "
                                   "prefill, mixed batches, preemption, n=2 seeded, abort mid-prefill; greedy on "
                                   "cpu-static); GGUF: test_gguf_granite_hybrid.py",
    "Olmo2ForCausalLM": "tests/models/test_transformers_fallback.py",
    "Starcoder2ForCausalLM": "tests/models/test_transformers_fallback.py",
    **{name: "tests/models/test_bert_encoder.py (hidden states, CLS row, classifier logits vs HF; varlen batch)"
       for name in ENCODER_ARCHITECTURES},
    "LlavaForConditionalGeneration": "tests/models/test_llava.py (processor output, image features, greedy tokens "
                                     "and log-probs vs HF; one and two images per prompt, chunks splitting an image, prefix-cache "
                                     "hits by image hash); tests/core/test_encoder_cache.py",
    **dict.fromkeys(("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
                    "tests/models/test_smolvlm.py (processor spans and tiles, image features, greedy tokens and "
                    "log-probs vs HF; tiled images, two images per prompt, chunks splitting an image, prefix-cache "
                    "hits by image hash)"),
    **dict.fromkeys(("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"),
                    "tests/models/test_qwen_vl.py (image processor output, M-RoPE positions, image features, greedy "
                    "tokens and log-probs vs HF; one and two images of different sizes, chunks splitting an image, "
                    "prefix-cache hits by image hash)"),
    "Gemma3ForConditionalGeneration": "tests/models/test_gemma3_vision.py (processor output, image features, greedy "
                                      "tokens and log-probs vs HF with its token types; one and two images, images "
                                      "kept whole in chunks, prefix hits cut back out of an image; spans off differ; cpu-static)",
}
# SmolLM2-135M Q4_1 (tests/models/test_smollm2.py); Falcon (Q8_0 multi-query, F32 grouped), Phi-3, Gemma 2/3 Q8_0
# (tests/models/test_gguf_families.py); Mistral,
# Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, Mixtral F32 and Q8_0 (tests/models/test_gguf_qwen_mistral.py); GLM-4, ChatGLM, Baichuan,
# DeepSeek-V2/V3 F32 and Q8_0 (tests/models/test_gguf_glm_baichuan_deepseek.py: configs from the metadata by
# models/gguf_archs.py, tokenizers by transformers' GGUF tokenizer conversion); StableLM F32 and Q8_0
# (tests/models/test_stablelm.py); LFM2 and Mamba2 F32 and Q8_0 (tests/models/test_gguf_hybrid.py); Qwen3.5,
# Qwen3.5-MoE and Qwen3-Next F32 and Q8_0 (tests/models/test_gguf_qwen35.py)
_GGUF_TESTED = {"LlamaForCausalLM": "yes (tested)",
                "Phi3ForCausalLM": "yes (tested; LongRoPE factors and partial rotary read from the file)",
                "MistralForCausalLM": "yes (tested; arch llama named mistral; GGUF has no sliding window: "
                                      "transformers' default 4096)",
                "Qwen2ForCausalLM": "yes (tested)", "Qwen3ForCausalLM": "yes (tested)",
                "Qwen2MoeForCausalLM": "yes (tested; every layer sparse, top-k not renormalised, as llama.cpp)",
                "Qwen3MoeForCausalLM": "yes (tested; arch qwen3moe: every layer sparse, top-k renormalised, as "
                                       "llama.cpp)",
                "MixtralForCausalLM": "yes (tested; arch llama with expert tensors, read by our loader, not "
                                      "transformers)",
                "Gemma2ForCausalLM": "yes (tested; soft-capping keys and query scale read as llama.cpp does)",
                "Gemma3ForCausalLM": "yes (tested; global-layer linear rope scaling and query scale read as llama.cpp "
                                     "does)",
                "FalconForCausalLM": "yes (tested; Falcon-7B multi-query and Falcon-40B grouped layouts)",
                "StableLmForCausalLM": "yes (tested; rotary width, rope base and per-head q/k norms read as "
                                       "llama.cpp does)",
                "Glm4ForCausalLM": "yes (tested; arch glm4, config from its metadata by pagedllm; BPE tokenizer "
                                   "tested)",
                "BaiChuanForCausalLM": "yes (tested; arch baichuan, config from its metadata by pagedllm, run as "
                                       "Llama; SentencePiece tokenizer tested)",
                "BaichuanForCausalLM": "yes (tested; arch baichuan: 40 layers run as 13B with ALiBi, as llama.cpp; "
                                       "other depths as 7B; SentencePiece tokenizer tested)",
                "DeepseekV2ForCausalLM": "yes (tested; arch deepseek2 with softmax gating, config from its metadata "
                                         "by pagedllm; attn_kv_b whole or split into attn_k_b/attn_v_b)",
                "DeepseekV3ForCausalLM": "yes (tested; arch deepseek2 with sigmoid gating and exp_probs_b, config "
                                         "from its metadata by pagedllm; YaRN with mscale = mscale_all_dim)",
                "ChatGLMModel": "yes (tested; arch chatglm, config from its metadata by pagedllm, run as Glm)",
                "GlmForCausalLM": "yes (tested; llama.cpp writes GLM as arch chatglm, which loads as Glm)",
                "GptOssForCausalLM": "yes (tested; arch gpt-oss from llama.cpp's own converter, F32, Q8_0 and "
                                     "MXFP4 experts: config from its metadata by pagedllm, sinks, split gate/up "
                                     "and expert transposes undone; expert tensors dequantized at load, MXFP4 "
                                     "included; tokenizer untested)",
                "Lfm2ForCausalLM": "yes (tested; arch lfm2, F32 and Q8_0: config by transformers' GGUF reader, "
                                   "conv layers from the per-layer KV head counts)",
                "Qwen3NextForCausalLM": "yes (tested; arch qwen3next, F32 and Q8_0: config from its metadata by "
                                        "pagedllm, w + 1 norms, A = -exp(A_log), conv shape undone, in_proj_qkvz "
                                        "rebuilt from attn_qkv and attn_gate; tokenizer untested)",
                "Qwen3_5ForCausalLM": "yes (tested; arch qwen35, F32 and Q8_0: config by transformers' GGUF reader, "
                                      "w + 1 norms, A = -exp(A_log), conv shape and tiled value heads undone)",
                "Qwen3_5MoeForCausalLM": "yes (tested; arch qwen35moe, F32 and Q8_0: as qwen35, experts stacked)",
                "Mamba2ForCausalLM": "yes (tested; arch mamba2, F32 and Q8_0: config from its metadata by pagedllm, "
                                     "A = -exp(A_log), D, norm and conv shapes undone; tokenizer untested)",
                "GraniteMoeHybridForCausalLM": "yes (tested; arch granitehybrid from llama.cpp's own converter, F32 "
                                               "and Q8_0, MoE and dense: config from its metadata by pagedllm, "
                                               "A = -exp(A_log), D, norm and conv shapes, q/k permute and split "
                                               "input_linear undone; no rotary, as llama.cpp runs these files; "
                                               "tokenizer untested)"}
_GGUF_ARCH = {"gemma3_text": "gemma3"}  # model_type -> GGUF architecture name where they differ
#: Which GGUF block types run packed and which are dequantized (backend/quantization kernels; docs/quantization.md).
GGUF_FORMATS = ("GGUF formats: Q4_0 and Q4_1 linears run packed on cpu (q4_gemv), Q8_0 and the K-quants Q4_K, Q5_K, "
                "Q6_K (Q4_K_M / Q5_K_M files) packed on cpu once its C++ ops are built (q8_gemv, kquant_gemv, else "
                "dequantized); every other type (Q2_K, Q3_K, IQ*, ...), and every type on a backend without the `gguf` "
                "method, is dequantized at load (docs/quantization.md).")
FAMILIES = {"LlamaForCausalLM": "Llama (Yi, SmolLM2)", "MistralForCausalLM": "Mistral", "Qwen2ForCausalLM": "Qwen2",
            "Qwen3ForCausalLM": "Qwen3", "Phi3ForCausalLM": "Phi-3", "Gemma2ForCausalLM": "Gemma 2",
            "Gemma3ForCausalLM": "Gemma 3 (text)", "MixtralForCausalLM": "Mixtral", "Qwen2MoeForCausalLM": "Qwen2-MoE",
            "Qwen3MoeForCausalLM": "Qwen3-MoE", "GptOssForCausalLM": "GPT-OSS",
            "DeepseekV2ForCausalLM": "DeepSeek-V2", "DeepseekV3ForCausalLM": "DeepSeek-V3", "GlmForCausalLM": "GLM",
            "Glm4ForCausalLM": "GLM-4", "FalconForCausalLM": "Falcon", "ChatGLMModel": "ChatGLM2/3, GLM-4",
            "BaiChuanForCausalLM": "Baichuan-7B", "BaichuanForCausalLM": "Baichuan2, 13B",
            "StableLmForCausalLM": "StableLM", "Lfm2ForCausalLM": "LFM2",
            "Qwen3NextForCausalLM": "Qwen3-Next", "Qwen3_5ForCausalLM": "Qwen3.5 (text)",
            "Qwen3_5MoeForCausalLM": "Qwen3.5-MoE (text)", "Olmo2ForCausalLM": "OLMo 2",
            "Mamba2ForCausalLM": "Mamba2",
            "GraniteMoeHybridForCausalLM": "Granite-4.0-H (Mamba2 hybrid)",
            "Starcoder2ForCausalLM": "StarCoder2",
            "BertModel": "BERT (embeddings)", "BertForSequenceClassification": "BERT (cross-encoder, classifier)",
            "RobertaModel": "RoBERTa (embeddings)",
            "RobertaForSequenceClassification": "RoBERTa (cross-encoder, classifier)",
            "XLMRobertaModel": "XLM-RoBERTa (embeddings)",
            "XLMRobertaForSequenceClassification": "XLM-RoBERTa (cross-encoder, classifier)",
            "LlavaForConditionalGeneration": "LLaVA (1.5-style: CLIP + projector + Llama-family decoder)",
            "Idefics3ForConditionalGeneration": "Idefics3 / SmolVLM (SigLIP + pixel-shuffle connector + Llama)",
            "SmolVLMForConditionalGeneration": "SmolVLM2 (SigLIP + pixel-shuffle connector + Llama)",
            "Qwen2VLForConditionalGeneration": "Qwen2-VL",
            "Qwen2_5_VLForConditionalGeneration": "Qwen2.5-VL",
            "Gemma3ForConditionalGeneration": "Gemma 3 (vision: SigLIP + pooling projector + Gemma 3)"}
#: The decoders' pooling forms checked against HF (tests/models/test_pooling_models.py)
_POOLING_TESTED = {
    "LlamaForSequenceClassification": "tests/models/test_pooling_models.py (probabilities, logits, per-token "
                                      "rewards vs HF)",
    "Qwen3ForSequenceClassification": "tests/models/test_pooling_models.py (probabilities, logits, cross-encoder "
                                      "scores vs HF; the Qwen3-Reranker conversion vs the causal LM's yes/no)",
    **{f"{f}Model": "tests/models/test_pooling_models.py (base checkpoint embeddings vs HF)" for f in ("Llama", "Qwen3")},
}
#: Native architectures the transformers fallback refuses (``models/fallback_support.py``), and why.
_FALLBACK_REFUSES = {"GptOssForCausalLM": "attention sinks", "Lfm2ForCausalLM": "convolution state",
                     **dict.fromkeys(("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"),
                                     "Gated DeltaNet state"),
                     "Mamba2ForCausalLM": "no attention to page, recurrent state",
                     "GraniteMoeHybridForCausalLM": "recurrent (Mamba2) state"}
#: Native modules whose layers keep recurrent state per request (state slots: core's model runner hands them to the
#: model, static shapes included; a backend running its own model runner refuses them).
_STATEFUL = ("lfm2", "qwen3_next", "mamba2", "granite_hybrid")
#: Capabilities a model may need (``config.py`` refuses it on a backend without them): always, or for some variants.
_NEEDS = {"Gemma2ForCausalLM": ("soft_cap",), "BaichuanForCausalLM": ("alibi 13B",),
          "FalconForCausalLM": ("alibi Falcon-RW",),
          "Gemma3ForConditionalGeneration": ("sliding_window", "mm_prefix_lm")}  # (its text_config's windows)


BACKENDS_NOTE = ("Backends: the installed ones whose capabilities declare what the model needs (sliding window, "
                 "soft-capping, MLA, attention sinks, bidirectional image spans, ALiBi for the variants in brackets); head sizes and dtypes are "
                 "checked when the model loads (`pagedllm backends --json`).")


def family(name: str) -> str:
    return FAMILIES.get(name) or re.sub(r"(ForCausalLM|Model)$", "", name)


def _needs(name: str) -> list[str]:
    spec = ARCHITECTURES.get(name)
    out = list(_NEEDS.get(name, ()))
    if spec is not None and spec.sliding != "none":
        out.append("sliding_window")
    if spec is not None and spec.attention == "mla":
        out.append("mla")
    if spec is not None and spec.sinks:
        out.append("attention_sinks")
    return out


def _names(chosen: list[str], every: list[str]) -> str:
    if chosen == every:
        return "all"
    rest = [n for n in every if n not in chosen]
    return ", ".join(chosen) if len(chosen) <= len(rest) else "all but " + ", ".join(rest)


def backends_for(name: str) -> str:
    """The installed backends whose ``Capabilities`` declare what the architecture needs (variants in brackets);
    installed = found through an entry point, not registered in-process (``register_backend``: tests, notebooks)."""
    from pagedllm.backend import registry  # heavy: torch, the plugins

    caps = {n: d.backend.capabilities for n, d in sorted(registry.discover().items())
            if d.backend is not None and d.distribution != "<registered>"}
    every = list(caps)
    needs = _needs(name)
    always = [n for n, c in caps.items() if all(getattr(c, need) for need in needs if " " not in need)]
    text = _names(always, every)
    for need in (n for n in needs if " " in n):
        cap, variant = need.split(" ")
        text += f" ({variant}, ALiBi: {_names([n for n in always if getattr(caps[n], cap)], every)})"
    return text


def _features(name: str) -> str:
    spec = ARCHITECTURES[name]
    out = []
    if spec.attention == "mla":
        out.append("MLA (latent KV cache), YaRN")
    if spec.moe != "none":
        out.append("MoE" + {"shared": " + shared expert", "deepseek": " (grouped top-k) + shared experts",
                             "gpt_oss": " (biased router, clamped SwiGLU experts with biases)"}.get(spec.moe, ""))
    if spec.sinks:
        out.append("attention sinks")
    if spec.module == "falcon":
        out.append("parallel attn+MLP, MQA/grouped KV, LayerNorm, ALiBi (alibi=True, Falcon-RW)")
    if spec.module == "stablelm":
        out.append("LayerNorm, partial rotary, parallel residual (optional), per-head q/k LayerNorm (optional)")
    if spec.module == "lfm2":
        out.append("short convolutions with recurrent state per request (state slots, contract v3; prefix caching "
                   "off, preemption by recompute or swap), GQA attention layers")
    if spec.module == "qwen3_next":
        out.append("Gated DeltaNet linear attention with conv and delta-rule state per request (state slots, "
                   "contract v3; prefix caching off, preemption by recompute or swap), gated attention with partial "
                   "rotary, (1+w) norms")
    if spec.module in ("mamba2", "granite_hybrid"):
        out.append("Mamba2 layers (conv + SSD state per request in state slots, contract v3; prefix caching off, "
                   "preemption by recompute or swap)")
    if spec.module == "mamba2":
        out.append("no attention layer (empty KV group)")
    if spec.module == "granite_hybrid":
        out.append("GQA attention layers (rotary or none), top-k MoE + shared MLP, Granite's embedding / residual / "
                   "attention multipliers and logits scaling")
    if spec.module == "bert":
        out.append("encoder-only: bidirectional `encoder_attention`, no KV cache, pooling runner (CLS default)")
    if spec.module == "llava":
        out.append("images (docs/multimodal.md): CLIP tower on `encoder_attention`, encoder cache, image-hashed "
                   "prefix blocks")
    if spec.module == "idefics3":
        out.append("images (docs/multimodal.md): tiles + global view, SigLIP tower on `encoder_attention`, encoder "
                   "cache, image-hashed prefix blocks")
    if spec.module == "qwen2_vl":
        out.append("images (docs/multimodal.md): ViT with 2-D rotary on `encoder_attention`, M-RoPE, encoder cache, "
                   "image-hashed prefix blocks")
    if spec.module == "gemma3_mm":
        out.append("images (docs/multimodal.md): SigLIP tower on `encoder_attention`, bidirectional image spans "
                   "(`mm_prefix_lm`), encoder cache, image-hashed prefix blocks; the Gemma 3 decoder's per-layer "
                   "windows and rotary bases")
    if spec.sliding != "none":
        out.append("sliding window" + (" (per layer)" if spec.sliding == "layer_types" else ""))
    if spec.qk_norm:
        out.append("q/k norm")
    if spec.gemma:
        out.append("soft-capping, (1+w) norms, GeGLU")
    return ", ".join(out) or "-"


def _gguf(name: str, model_type: str) -> str:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # heavy: transformers

    if name in _GGUF_TESTED:
        return _GGUF_TESTED[name]
    return "readable, untested" if _GGUF_ARCH.get(model_type, model_type) in GGUF_SUPPORTED_ARCHITECTURES else "no"


def fallback_architectures() -> list[str]:
    """Every transformers ``*ForCausalLM`` the fallback accepts (decoder-only, attention routed through
    ``AttentionInterface`` with the caller's arguments)."""
    import transformers  # heavy: transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # heavy: transformers

    names = set()
    for name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        if isinstance(name, str) and name.endswith("ForCausalLM"):
            try:
                cls = getattr(transformers, name, None)
            except Exception:  # an optional dependency of that model is missing
                continue
            if getattr(cls, "_supports_attention_backend", False):
                names.add(name)
    return sorted(names)


def rows() -> list[dict[str, Any]]:
    model_types = {v: k for k, v in _BY_MODEL_TYPE.items()}
    fallback = set(fallback_architectures())
    out = []
    for name in ARCHITECTURES:
        spec = ARCHITECTURES[name]
        static = (" (static shapes too: cpu-static keeps its state slots in the bucket buffers; a backend with its "
                  "own model runner refuses it at start-up)")
        out.append({"family": family(name), "architecture": name,
                    "backends": backends_for(name) + (static if spec.module in _STATEFUL else ""),
                    "path": "native" + (f" (the transformers fallback refuses it: {_FALLBACK_REFUSES[name]})"
                                        if name in _FALLBACK_REFUSES else
                                        " (transformers via --model-impl)" if name in fallback else ""),
                    "features": _features(name), "gguf": _gguf(name, model_types.get(name, "")),
                    "lora": "yes" if spec.moe == "none" and not spec.gemma and spec.attention == "mha"
                    and spec.module == "decoder" else "no",
                    "verified": VERIFIED.get(name, "-")})
    for name, base in POOLING_ARCHITECTURES.items():  # the native decoder as a pooling model (docs/pooling.md)
        head = name.endswith("ForSequenceClassification")
        out.append({"family": family(base) + (" (sequence classification)" if head else " (base model, embeddings)"),
                    "architecture": name, "backends": backends_for(base), "path": "native, pooling runner",
                    "features": ("`score` head: classify, score (1 label), reward" if head
                                 else "no LM head: embed, encode") + (f"; {_features(base)}"
                                                                      if _features(base) != "-" else ""),
                    "gguf": "no", "lora": "untested",
                    "verified": _POOLING_TESTED.get(name, "-")})
    for name, what in REMOTE_LAYOUTS.items():
        out.append({"family": family(name), "architecture": name, "backends": backends_for(name),
                    "path": "native, remote-code layout mapped by name", "features": what,
                    "gguf": _GGUF_TESTED.get(name, "no"), "lora": "untested",
                    "verified": VERIFIED.get(name, "mapping shared with the row above; NormHead unit-tested")})
    for name in sorted(n for n in VERIFIED if n not in ARCHITECTURES and n not in REMOTE_LAYOUTS):
        model_type = name.removesuffix("ForCausalLM").lower()
        out.append({"family": family(name), "architecture": name, "backends": backends_for(name),
                    "path": "transformers fallback", "features": "-",
                    "gguf": _gguf(name, model_type), "lora": "no", "verified": VERIFIED[name]})
    return out


def markdown_table() -> str:
    import transformers  # heavy: transformers

    lines = ["| Family | Architecture | Path | Backends | Native features | GGUF | LoRA | Oracle tests |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows():
        lines.append(f"| {r['family']} | `{r['architecture']}` | {r['path']} | {r['backends']} | {r['features']} "
                     f"| {r['gguf']} | {r['lora']} | {r['verified']} |")
    others = [n for n in fallback_architectures() if n not in ARCHITECTURES and n not in VERIFIED]
    lines.append("")
    lines.append(f"Through the transformers fallback: {len(others)} more decoder-only `*ForCausalLM` classes of "
                 f"transformers {transformers.__version__} route attention through `AttentionInterface` (`pagedllm "
                 "models --json` lists them); each checkpoint is checked at start-up and refused, naming the feature, "
                 "if the fallback would run it wrong (see [What the fallback refuses](#what-the-fallback-refuses)).")
    lines.append("")
    lines.append(GGUF_FORMATS)
    lines.append("")
    lines.append(BACKENDS_NOTE)
    return "\n".join(lines) + "\n"
