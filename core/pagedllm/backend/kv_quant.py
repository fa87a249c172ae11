"""FP8 KV cache (vLLM's ``kv_cache_dtype``): dtype names, and the exact quantize / dequantize every kernel matches.

A cache in ``float8_e4m3fn`` / ``float8_e5m2`` holds ``saturate(x * (1 / scale))`` rounded to nearest-even (the
reciprocal as a float32, so every kernel reproduces it bit for bit with one IEEE multiply); a read gives
``stored * scale``. Each attention layer has one ``k_scale`` and one ``v_scale`` (float, default 1.0, or the
checkpoint's ``k_scale`` / ``v_scale`` tensors, as vLLM reads them). With ``auto`` the cache is in the model dtype and
the scales are ignored. Half the bytes of bf16 (a quarter of fp32) per element: twice (4x) the blocks in one budget.
"""

from __future__ import annotations

from typing import Optional

import torch

#: vLLM's names; ``fp8`` is e4m3 (vLLM's default FP8 format).
KV_CACHE_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def canonical_kv_dtype(name: str) -> str:
    """``fp8`` -> ``fp8_e4m3`` (what backends declare); other names unchanged."""
    return "fp8_e4m3" if name == "fp8" else name


def kv_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for ``kv_cache_dtype=name`` (``auto``: the model dtype)."""
    dt = KV_CACHE_DTYPES[name]
    return model_dtype if dt is None else dt


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x`` into a cache of ``dtype``: for fp8, ``x * (1 / scale)`` in float32, saturated to the format's max,
    rounded to nearest-even; otherwise a plain cast (scale ignored)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    y = x.float() if scale == 1.0 else x.float() * (1.0 / scale)
    return y.clamp(-fmax, fmax).to(dtype)  # not in place: x.float() may be the caller's tensor


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache contents as ``dtype``: fp8 values times ``scale`` (in float32, then cast); others a plain cast."""
    if not is_fp8(x.dtype):
        return x.to(dtype)
    y = x.float()
    return (y if scale == 1.0 else y * scale).to(dtype)


def kv_scale_names(layer_prefix: str, which: str) -> tuple[str, ...]:
    """Checkpoint names of one attention layer's ``k_scale`` / ``v_scale`` (``which`` = ``k`` or ``v``), as vLLM
    reads them: compressed-tensors / llm-compressor ``self_attn.k_scale``, older AutoFP8 ``self_attn.k_proj.k_scale``,
    ModelOpt ``self_attn.k_proj.output_scale``, and vLLM's own ``self_attn.attn.k_scale``."""
    a = f"{layer_prefix}self_attn."
    return (f"{a}{which}_scale", f"{a}{which}_proj.{which}_scale", f"{a}{which}_proj.output_scale",
            f"{a}attn.{which}_scale")


def load_kv_scales(attentions: list, weights: object, prefix: str) -> int:
    """Set ``k_scale`` / ``v_scale`` of each attention module from the checkpoint (a scalar tensor each, read as a
    float); modules without them keep 1.0. Returns how many layers had scales."""
    found = 0
    for i, attn in enumerate(attentions):
        if attn is None or not hasattr(attn, "k_scale"):  # e.g. MLA layers: no fp8 cache (refused), no scales
            continue
        for which in ("k", "v"):
            name = next((n for n in kv_scale_names(f"{prefix}layers.{i}.", which) if n in weights), None)
            if name is not None:
                t = weights.take(name)
                if t.numel() != 1:
                    raise ValueError(f"{name}: per-tensor KV scales only (a scalar), got shape {tuple(t.shape)}")
                setattr(attn, f"{which}_scale", float(t.float().reshape(())))
                found += which == "k"
    return found
