"""FP8 (e4m3) weights, vLLM's ``fp8`` method: checkpoints that store them, and online quantization of dense ones.

Layouts read (the weight ``float8_e4m3fn [out, in]`` plus, beside it):

- ``weight_scale`` float32, a scalar / ``[1]`` (per-tensor: vLLM's ``fp8`` and compressed-tensors' float-quantized
  ``strategy: tensor``) or ``[out]`` / ``[out, 1]`` (per-channel: compressed-tensors ``strategy: channel``);
- ``weight_scale_inv`` float32 ``[ceil(out/128), ceil(in/128)]`` (block-wise, ``weight_block_size: [128, 128]`` as
  transformers' FineGrainedFP8 and DeepSeek-V3 write it; the name notwithstanding, it multiplies).

``dense = weight.float() * scale`` broadcast per tensor, row or block. Online (``quantization="fp8"`` on a dense
checkpoint, as vLLM): per-tensor, ``scale = amax / 448``, ``weight = saturate(w / scale)`` in e4m3. Activations are
never quantized (weight-only, W8A16). On CPU no kernel beats dequantizing once at load (docs/quantization.md).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization.base import QuantizationMethod, register_method

logger = logging.getLogger(__name__)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
#: Weight types: how the scale is laid out.
TENSOR, CHANNEL, BLOCK = "e4m3_tensor", "e4m3_channel", "e4m3_block"
BLOCK_SIZE = (128, 128)


def _scale_type(scale: torch.Tensor, shape: tuple[int, int], block: bool) -> str:
    """``block``: the scale is ``weight_scale_inv`` (a single 128x128 block is still a block, so fused parts agree)."""
    if scale.numel() == 1 and not block:
        return TENSOR
    if scale.numel() == shape[0] and (scale.dim() == 1 or scale.shape[-1] == 1):
        return CHANNEL
    bo, bi = BLOCK_SIZE
    if tuple(scale.shape) == (-(-shape[0] // bo), -(-shape[1] // bi)):
        return BLOCK
    raise ValueError(f"fp8 weight {shape}: weight_scale of shape {tuple(scale.shape)} is neither per-tensor, "
                     f"per-channel nor {bo}x{bi} blocks")


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, weight_type: str) -> torch.Tensor:
    """Float32 ``[out, in]`` of an e4m3 weight and its scale (see the module docstring)."""
    w = weight.float()
    if weight_type == TENSOR:
        return w * scale.float().reshape(())
    if weight_type == CHANNEL:
        return w * scale.float().reshape(-1, 1)
    bo, bi = BLOCK_SIZE
    full = scale.float().repeat_interleave(bo, 0).repeat_interleave(bi, 1)
    return w * full[: w.shape[0], : w.shape[1]]


def quantize_fp8(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's online quantization: per-tensor ``scale = amax / 448`` (float32 scalar), e4m3 weight, saturated."""
    w = dense.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=1e-12)
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale.reshape(())


class FP8Method(QuantizationMethod):
    name = "fp8"

    def weight_types(self) -> tuple[str, ...]:
        return (TENSOR, CHANNEL, BLOCK)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        return dequantize_fp8(weight.data, weight.tensors["weight_scale"], weight.weight_type)

    def check_config(self, qc: dict) -> None:
        """``quantization_config`` of an fp8 checkpoint: e4m3, per tensor/channel or 128x128 blocks."""
        is_fp8_checkpoint(qc)

    def fuse(self, parts: list[QuantizedWeight]) -> Optional[QuantizedWeight]:
        """Fused q/k/v or gate/up: per-tensor parts become one per-channel weight (each part's scale on its rows,
        exact); block parts concatenate when every part's rows fill whole blocks; else None (dequantized)."""
        if len(parts) == 1:
            return parts[0]
        data = torch.cat([p.data for p in parts])
        shape = (data.shape[0], parts[0].shape[1])
        wtype = parts[0].weight_type
        if wtype == BLOCK:
            if any(p.shape[0] % BLOCK_SIZE[0] for p in parts[:-1]):
                return None
            scale = torch.cat([p.tensors["weight_scale"] for p in parts])
        else:
            scale = torch.cat([p.tensors["weight_scale"].float().reshape(-1).expand(p.shape[0]) for p in parts])
            wtype = CHANNEL
        return QuantizedWeight(self.name, wtype, data, shape, tensors={"weight_scale": scale})


FP8 = register_method(FP8Method())


def random_fp8_weight(weight_type: str, rows: int, cols: int, gen: torch.Generator) -> QuantizedWeight:
    """A valid ``weight_type`` weight (std ~0.1 once dequantized) for conformance and tests."""
    data = (torch.randn(rows, cols, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    shape = {TENSOR: (1,), CHANNEL: (rows, 1), BLOCK: (-(-rows // BLOCK_SIZE[0]), -(-cols // BLOCK_SIZE[1]))}
    scale = 1e-3 * (0.5 + torch.rand(shape[weight_type], generator=gen))
    return QuantizedWeight("fp8", weight_type, data, (rows, cols), tensors={"weight_scale": scale})


class FP8Weights:
    """A checkpoint source seen through the fp8 method: ``quantized(name)`` gives the e4m3 weight and its scale
    (``online``: quantizes a dense weight), ``take(name)`` a dense float32 tensor (fp8 ones dequantized), so the
    layers left dense (embeddings, ``lm_head``, mixed fused parts) load as before."""

    def __init__(self, source: Any, online: bool):
        self.source, self.online = source, online

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def __getattr__(self, name: str) -> Any:  # names(), config... of the wrapped source
        return getattr(self.source, name)

    def _scale_name(self, name: str) -> Optional[str]:
        base = name.removesuffix(".weight")
        return next((f"{base}.{s}" for s in ("weight_scale", "weight_scale_inv") if f"{base}.{s}" in self.source),
                    None)

    def quantized(self, name: str) -> Optional[QuantizedWeight]:
        if not name.endswith(".weight") or name not in self.source:
            return None
        scale_name = self._scale_name(name)
        if scale_name is None:
            if not self.online:
                return None
            data, scale = quantize_fp8(self.source.take(name))
        else:
            data, scale = self.source.take(name), self.source.take(scale_name).float()
            if data.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{name}: fp8 checkpoints store float8_e4m3fn weights, found {data.dtype}")
        shape = (data.shape[0], data.shape[1])
        block = scale_name is not None and scale_name.endswith("_inv")
        return QuantizedWeight("fp8", _scale_type(scale, shape, block), data, shape, tensors={"weight_scale": scale})

    def take(self, name: str) -> torch.Tensor:
        t = self.source.take(name)
        if t.dtype != torch.float8_e4m3fn:
            return t
        scale_name = self._scale_name(name)
        if scale_name is None:
            raise ValueError(f"{name} is float8_e4m3fn but the checkpoint has no weight_scale for it")
        scale = self.source.take(scale_name)
        return dequantize_fp8(t, scale, _scale_type(scale, tuple(t.shape), scale_name.endswith("_inv")))


def is_fp8_checkpoint(config: Any) -> bool:
    """vLLM's ``fp8`` method: ``quantization_config.quant_method == "fp8"`` (e4m3 only)."""
    qc = config if isinstance(config, dict) else getattr(config, "quantization_config", None)
    qc = qc if isinstance(qc, dict) else (qc.to_dict() if hasattr(qc, "to_dict") else {})
    if qc.get("quant_method") != "fp8":
        return False
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt {fmt!r}: fp8 weights are read in e4m3 only")
    block = qc.get("weight_block_size")
    if block is not None and tuple(block) != BLOCK_SIZE:
        raise ValueError(f"quantization_config.weight_block_size {block}: only {list(BLOCK_SIZE)} is read")
    return True
