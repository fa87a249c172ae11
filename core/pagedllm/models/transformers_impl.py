"""The Transformers fallback: any decoder-only ``*ForCausalLM`` transformers implements, with OUR paged attention.

As vLLM's Transformers backend does, the HF module runs as-is (its embeddings, norms, rotary, MLPs), with
``attn_implementation="pagedllm"``: a function registered in transformers' ``AttentionInterface`` that writes the new
K/V into the paged cache and calls the backend's ``paged_attention``. The step's metadata reaches it explicitly, as a
keyword argument the HF model forwards down to every attention call (no global state). HF builds no mask for an
attention implementation it does not know, and runs with ``use_cache=False``: the paged cache is the only cache, so
continuous batching, chunked prefill and prefix caching work as for native models. A model this would run wrong
(state other than attention K/V, attention or head features the paged path does not apply) is refused at start-up,
naming the feature (``fallback_support``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.fallback_support import (AttentionProbe, MissingPagedContext, check_config, check_modules,
                                              probe)
from pagedllm.models.paths import is_gguf

ATTN_IMPLEMENTATION = "pagedllm"


@dataclass
class PagedContext:
    """What one forward's attention calls need: the step's metadata, the per-layer caches and the backend ops."""

    meta: AttentionMetadata
    kv_caches: list
    write_kv: Any
    paged_attention: Any


def paged_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                            dropout: float = 0.0, sliding_window: Optional[int] = None,
                            softcap: Optional[float] = None, pagedllm: Optional[PagedContext] = None,
                            **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q ``[1, H, T, D]``, k/v ``[1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
    if isinstance(pagedllm, AttentionProbe):  # the start-up check (fallback_support.probe)
        return pagedllm(module, query, key, value, attention_mask, scaling, sliding_window, softcap, kwargs), None
    if pagedllm is None:
        raise MissingPagedContext("pagedllm attention called without its PagedContext (run the model through "
                                  "TransformersCausalLM.forward)")
    cache = pagedllm.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    hooks = pagedllm.meta.kv_connector  # a KV connector's loads land before the read; the write may be saved
    if hooks is not None:
        hooks.wait_for_layer_load(cache)
    pagedllm.write_kv(k, v, cache, pagedllm.meta.slot_mapping, 1.0, 1.0)  # fp8 KV: unit scales (docs/quantization.md)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = pagedllm.paged_attention(q.contiguous(), cache, pagedllm.meta, scale, sliding_window, softcap, 1.0, 1.0)
    if hooks is not None:
        hooks.save_kv_layer(cache, pagedllm.meta)
    return out.unsqueeze(0), None


def register_attention() -> None:
    """Register ``pagedllm`` in transformers' AttentionInterface (idempotent)."""
    from transformers import AttentionInterface  # heavy: transformers

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)


def transformers_architecture(config: Any, check: bool = True) -> str:
    """The ``*ForCausalLM`` class transformers has for ``config``; UnsupportedModelError naming it, or (``check``)
    the feature of the config the fallback cannot run (``fallback_support.check_config``), otherwise."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # heavy: transformers

    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{', '.join(archs) or model_type} is an encoder-decoder model; pagedllm runs "
                                    "decoder-only *ForCausalLM models only")
    known = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    found = next((n for n in archs if n in known and n.endswith("ForCausalLM")), None)
    if found is None and not archs and model_type:
        found = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        found = found if found and found.endswith("ForCausalLM") else None
    if found is None:
        raise UnsupportedModelError(f"architecture {', '.join(archs) or repr(model_type)} has no decoder-only "
                                    "*ForCausalLM class in transformers (remote code never runs)")
    import transformers  # heavy: transformers

    if not getattr(getattr(transformers, found, None), "_supports_attention_backend", False):
        raise UnsupportedModelError(f"transformers' {found} does not route attention through AttentionInterface "
                                    "with the caller's arguments (_supports_attention_backend is False), so the "
                                    "transformers fallback cannot run it")
    if check:
        check_config(config, found)
    return found


def _head_size(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def num_kv_heads_of(config: Any) -> int:
    for name in ("num_key_value_heads", "num_kv_heads"):
        n = getattr(config, name, None)
        if n:
            return int(n)
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return 1
    return config.num_attention_heads


class TransformersCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind pagedllm's model interface (``forward(ids, positions, meta)``,
    ``compute_logits``, ``kv_caches``, shapes). Build it with :func:`load_transformers_model`. A model with weights
    is probed once here (``fallback_support.probe``): what the paged path would run differently from HF is refused.
    ``check=False`` skips every rule of ``fallback_support`` (for a caller that runs them itself)."""

    def __init__(self, hf_model: nn.Module, backend: Any, check: bool = True):
        super().__init__()
        config = hf_model.config
        self.hf = hf_model
        self.config = config
        self.architecture = transformers_architecture(config, check)
        text = config.get_text_config(decoder=True)  # the config itself, or a composite model's text part
        self.num_layers: int = text.num_hidden_layers
        self.num_heads: int = text.num_attention_heads
        self.num_kv_heads: int = num_kv_heads_of(text)
        self.head_size: int = _head_size(text)
        self.hidden_size: int = text.hidden_size
        self.vocab_size: int = text.vocab_size
        self.max_model_len: int = getattr(text, "max_position_embeddings", 2048)
        self.sliding_window: Optional[int] = None  # no model-wide block freeing: layers may differ
        self.tie_word_embeddings = bool(getattr(text, "tie_word_embeddings", False))
        self.final_logit_softcapping: Optional[float] = getattr(text, "final_logit_softcapping", None)
        self.eos_token_ids: list[int] = []
        self.kv_caches: list = []
        self.write_kv, self.paged_attention = backend.write_kv, backend.paged_attention
        self.decoder = hf_model.get_decoder()
        self.lm_head = hf_model.get_output_embeddings()
        if check:
            check_modules(hf_model, self.architecture)
            if self.device.type != "meta":
                probe(self, self.architecture)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.hf.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.hf.parameters()).device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> the decoder's final-normed hidden states ``[T, hidden_size]``."""
        ctx = PagedContext(meta, self.kv_caches, self.write_kv, self.paged_attention)
        out = self.decoder(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                           pagedllm=ctx)
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]``, with the model's final soft-capping (Gemma 2) if any."""
        logits = self.lm_head(hidden)
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits


def load_transformers_model(path: str, config: Any, *, backend: Any, dtype: torch.dtype,
                            device: torch.device) -> TransformersCausalLM:
    """transformers' own loader (safetensors folders) with our attention registered; remote code never runs."""
    from transformers import AutoModelForCausalLM  # heavy: transformers

    arch = transformers_architecture(config)
    register_attention()
    try:  # the module's rules before any weight is read (they run again on the loaded module)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, attn_implementation=ATTN_IMPLEMENTATION)
    except Exception:  # noqa: BLE001 - a module that cannot be built on the meta device is checked once loaded
        skeleton = None
    if skeleton is not None:
        check_modules(skeleton, arch)
    where = dict(gguf_file=os.path.basename(path)) if is_gguf(path) else {}
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path) if where else path, config=config, dtype=dtype,
                                              device_map=device, attn_implementation=ATTN_IMPLEMENTATION,
                                              trust_remote_code=False, **where)
    return TransformersCausalLM(hf.eval().requires_grad_(False), backend)
