"""``read_model_info``: what a backend may decide the engine config from, read before any weight is loaded."""

from __future__ import annotations

from typing import Any

import torch

from pagedllm.backend.hookspec import ModelInfo
from pagedllm.models.alibi import uses_alibi
from pagedllm.models.bert import encoder_max_positions
from pagedllm.models.arch import architecture_of, kv_cache_shape, layer_sliding_windows, resolve_model_impl
from pagedllm.models.gpt_oss import is_mxfp4_checkpoint
from pagedllm.models.gemma3_mm import gemma3_mm_model_info
from pagedllm.models.llava import llava_model_info, text_config_of
from pagedllm.models.qwen2_vl import qwen2_vl_model_info, qwen2_vl_text_config
from pagedllm.models.mamba2 import DEFAULT_MAX_POSITIONS
from pagedllm.models.paths import is_gguf
from pagedllm.models.state_info import state_layer_info
from pagedllm.models.transformers_impl import num_kv_heads_of
from pagedllm.quantization.config import checkpoint_quantization


def checkpoint_dtype(config: Any) -> str:
    """The checkpoint's dtype name (``dtype`` in transformers >= 4.56 configs, ``torch_dtype`` before); float32
    when the config names none (GGUF configs: weights are dequantized to the engine dtype)."""
    # vars(): newer configs turn a `torch_dtype` attribute read into a deprecation warning
    dt = getattr(config, "dtype", None) or vars(config).get("torch_dtype")
    if isinstance(dt, str):
        dt = getattr(torch, dt, None)
    return str(dt).removeprefix("torch.") if isinstance(dt, torch.dtype) else "float32"


def read_model_info(model_path: str, config: Any, model_impl: str = "auto") -> ModelInfo:
    """Shapes, dtype and attention features of the checkpoint at ``model_path`` (its HF ``config``), for the
    implementation ``model_impl`` picks."""
    name, impl = resolve_model_impl(config, model_impl)
    if impl == "native" and architecture_of(config)[1].module in ("llava", "idefics3"):  # a VLM: its decoder's shapes
        return llava_model_info(config, read_model_info(model_path, text_config_of(config), "native"))
    if impl == "native" and architecture_of(config)[1].module == "gemma3_mm":  # a VLM: its decoder's shapes
        return gemma3_mm_model_info(config, read_model_info(model_path, text_config_of(config), "native"))
    if impl == "native" and architecture_of(config)[1].module == "qwen2_vl":  # a VLM: its decoder's shapes
        return qwen2_vl_model_info(config, read_model_info(model_path, qwen2_vl_text_config(config), "native"))
    if impl == "native":
        windows = [w for w in layer_sliding_windows(config, architecture_of(config)[1]) if w is not None]
    else:
        window = getattr(config, "sliding_window", None)
        windows = [window] if isinstance(window, int) else []
    heads = getattr(config, "num_attention_heads", None) or 1  # pure Mamba2: no attention layer
    mla, sinks = False, False
    if impl == "native":  # MLA: the cache's one latent row per token; GPT-OSS's attention sinks
        sinks = architecture_of(config)[1].sinks
        kv_heads, head_size, mla = kv_cache_shape(config, architecture_of(config)[1])
    else:
        kv_heads, head_size = num_kv_heads_of(config), getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelInfo(
        architecture=name,
        dtype=checkpoint_dtype(config),
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_size=head_size,
        vocab_size=config.vocab_size,
        max_model_len=(encoder_max_positions(config) if impl == "native"  # RoBERTa: 514 rows hold 512 tokens
                       and architecture_of(config)[1].module == "bert"
                       else getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS),
        sliding_window=max(windows) if windows else None,
        soft_cap=getattr(config, "attn_logit_softcapping", None),
        alibi=uses_alibi(config),
        # GPT-OSS MXFP4 experts are dequantized at load: the engine sees a dense checkpoint
        quantization="gguf" if is_gguf(model_path) else (None if is_mxfp4_checkpoint(config)
                                                           else checkpoint_quantization(config)),
        mla=bool(mla),
        attention_sinks=sinks,
        state=state_layer_info(config) if impl == "native" else (),  # the fallback refuses stateful layers itself
    )
