"""Swap a meta-device model's ``nn.Linear`` layers for ``QuantizedLinear`` where the checkpoint keeps them packed."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch
from torch import nn

from pagedllm.models.heap import trim_heap
from pagedllm.models.weights import checkpoint_prefix, source_names
from pagedllm.quantization import get_method, make_quantized_linear
from pagedllm.quantization.linear import SplitQuantizedLinear

logger = logging.getLogger(__name__)


def quantize_linears(model: nn.Module, weights: Any, backend: Any, dtype: torch.dtype, device: Any,
                     progress: Optional[Callable[[int], Any]] = None) -> int:
    """Replace every linear whose checkpoint parts are packed (fused parts joined by the method's ``fuse``) with a
    ``QuantizedLinear`` on the backend's kernel (parts packed in different block types: a ``SplitQuantizedLinear``
    of one per part); returns how many. Other parts that cannot share one layout (partly dense, GPTQ act-order
    permuted differently) stay ``nn.Linear`` (dequantized at load, logged), and so does ``lm_head``. Biases stay
    parameters, loaded with the rest of the state dict. ``progress(1)`` is called per linear swapped (the loader's
    progress bar)."""
    prefix = checkpoint_prefix(weights)
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or name == "lm_head":  # compute_logits reads lm_head's dense weight
            continue
        parts = [weights.quantized(n) for n in source_names(f"{name}.weight", prefix)]
        if all(p is None for p in parts):
            continue
        weight = None if any(p is None for p in parts) else (
            parts[0] if len(parts) == 1 else get_method(parts[0].method).fuse(parts))
        split = weight is None and all(p is not None for p in parts) and len({p.weight_type for p in parts}) > 1
        if weight is None and not split:
            logger.info("%s: parts stored as %s cannot share one packed layout; dequantized to %s at load", name,
                        [p.weight_type if p else "dense" for p in parts], dtype)
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if split:  # packed parts of different block types: each on its own kernel, outputs joined
            setattr(parent, leaf, SplitQuantizedLinear([make_quantized_linear(backend, p, False, dtype, device)
                                                        for p in parts], module.bias is not None))
        else:
            setattr(parent, leaf, make_quantized_linear(backend, weight, module.bias is not None, dtype, device))
        if hasattr(weights, "release"):  # GGUF: unmap the file pages of parts the kernel copied rather than kept
            weights.release(parts, getattr(parent, leaf))
        if swapped % 4 == 3:  # give the freed repack transients back now, not at the end: they set the load's peak
            trim_heap()
        swapped += 1
        if progress is not None:
            progress(1)
    return swapped
