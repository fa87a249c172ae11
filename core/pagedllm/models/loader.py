"""``load_model``: HF config + checkpoint (folder or GGUF) -> a native ``CausalLM`` on the backend's device."""

from __future__ import annotations

import os
from typing import Any, Optional

import torch

from pagedllm.models.arch import architecture_of
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.paths import is_gguf, resolve_model_path
from pagedllm.models.rope import build_cos_sin_cache
from pagedllm.models.gguf_weights import GGUFWeights
from pagedllm.models.quantized_linears import quantize_linears
from pagedllm.models.weights import SafetensorsWeights, fused_state_dict


def load_config(model_path: str) -> Any:
    """The HF config, never running remote code; for GGUF, the one transformers derives from the metadata."""
    from transformers import AutoConfig

    if is_gguf(model_path):
        return AutoConfig.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    return AutoConfig.from_pretrained(model_path, trust_remote_code=False)


def eos_token_ids(model_path: str, config: Any) -> list[int]:
    """Stop ids: ``generation_config.json`` when the folder has one (chat models list several), else the config's."""
    eos = getattr(config, "eos_token_id", None)
    if not is_gguf(model_path) and os.path.isfile(os.path.join(model_path, "generation_config.json")):
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        if gen.eos_token_id is not None:
            eos = gen.eos_token_id
    ids = eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    return list(dict.fromkeys(int(i) for i in ids))


def load_model(model_path: str, *, backend: Any, dtype: torch.dtype, device: torch.device,
               config: Any = None, quantization: Optional[str] = None) -> CausalLM:
    """Build the native model for ``model_path`` (HF ``config`` if already read) with weights in ``dtype`` on
    ``device``. Unsupported architectures fail (ValueError) before any weight is read. ``quantization`` (a method
    name, resolved by ``pagedllm.quantization.resolve_quantization``) keeps packed linear weights packed and runs
    them through the backend's kernel; ``None`` dequantizes everything to ``dtype``.
    """
    path = resolve_model_path(model_path)
    device = torch.device(device)
    config = config if config is not None else load_config(path)
    _, spec = architecture_of(config)
    with torch.device("meta"):
        model = CausalLM(config, spec, backend)
    weights = GGUFWeights(path, config) if is_gguf(path) else SafetensorsWeights(path)
    if quantization is not None:
        quantize_linears(model, weights, backend, dtype, device)
    model.load_state_dict(fused_state_dict(model, weights, dtype, device), strict=True, assign=True)
    del weights
    model.cos_sin_cache = build_cos_sin_cache(config, model.max_model_len, device)
    model.eos_token_ids = eos_token_ids(path, config)
    return model.requires_grad_(False).eval()
