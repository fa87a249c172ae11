"""Hand a loaded model's dense linear layers to the backend's dense kernel, when it has one.

vLLM treats unquantized weights as one more linear method (``UnquantizedLinearMethod``) whose CPU version repacks
each weight once for oneDNN; here the same question goes through the same hook as quantized weights:
``pagedllm_quantized_linear("unquantized", <dtype name>)``. A backend without a dense kernel answers ``None`` and
the model keeps ``nn.Linear`` (``F.linear``) unchanged.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.hookspec import QuantizedLinearKernel, QuantizedWeight
from pagedllm.models.gguf_weights import drop_unless_kept
from pagedllm.models.heap import trim_heap
from pagedllm.models.quantized_embedding import QuantizedEmbedding


class DenseKernelLinear(nn.Module):
    """An ``nn.Linear`` whose weight the backend's dense kernel holds in its own layout (``state``)."""

    def __init__(self, linear: nn.Linear, kernel: QuantizedLinearKernel, state: Any):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.kernel_name, self._apply_kernel, self.state = kernel.name, kernel.apply, state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._apply_kernel(self.state, x, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel_name}"


def dense_weight(weight: torch.Tensor) -> QuantizedWeight:
    return QuantizedWeight("unquantized", str(weight.dtype).removeprefix("torch."), weight.detach(),
                           tuple(weight.shape))


def pack_dense_linears(model: nn.Module, backend: Any, dtype: torch.dtype, device: Any,
                       quantized: bool = False) -> int:
    """Swap every ``nn.Linear`` of ``model`` for the backend's dense kernel, and give ``compute_logits`` a packed
    LM head (a copy: the tied embedding and ``lm_head_weight`` stay as they are; a tied GGUF-packed embedding gets
    its dense head here, also where the backend has no dense kernel, unless the loader gave it one over its blocks as
    they are: ``block_head``). Returns how many were swapped.

    ``quantized``: the decoder's linears all run on the backend's quantized kernels, not core's exact reference
    (the weights are already rounded to 4-8 bits); a float32 LM head then runs in bf16 where the backend has a bf16 dense kernel, halving the bytes the largest single matrix
    streams per token (SmolLM2's tied 49152 x 576 head was a quarter of a Q4_1 batch-1 step in fp32)."""
    head_kernel = None
    if model.lm_head_kernel is None and quantized and dtype == torch.float32:
        head_kernel = backend.quantized_linear("unquantized", "bfloat16")
    kernel = backend.quantized_linear("unquantized", str(dtype).removeprefix("torch."))
    if head_kernel is not None:
        apply, state = _lm_head(model, head_kernel, torch.bfloat16, device)
        model.lm_head_kernel = (lambda st, x, b: apply(st, x.to(torch.bfloat16), b).to(x.dtype), state)
    if kernel is None:
        if model.lm_head_kernel is None and _packed_tied_embedding(model):  # F.linear on one dense copy
            model.lm_head_kernel = (lambda w, x, b: F.linear(x, w, b), model.lm_head_weight)
        return 0
    swapped = 0
    for name, module in list(model.named_modules()):
        if hasattr(module, "use_dense_kernel") and module.weight is not None and module.weight.dtype == dtype:
            # a linear that communicates (tensor parallel's row-parallel layers): its local product on the kernel
            module.use_dense_kernel(kernel.apply, kernel.prepare(dense_weight(module.weight), dtype, device))
            swapped += 1
            continue
        if type(module) is not nn.Linear or name == "lm_head" or module.weight.dtype != dtype:
            continue
        packed = DenseKernelLinear(module, kernel, kernel.prepare(dense_weight(module.weight), dtype, device))
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, packed)
        swapped += 1
    if model.lm_head_kernel is None and (_packed_tied_embedding(model) or model.lm_head_weight.dtype == dtype):
        model.lm_head_kernel = _lm_head(model, kernel, dtype, device)
    return swapped


_BLOCK_HEAD_TYPES = ("Q8_0", "Q4_K", "Q5_K", "Q6_K")


def block_head(model: nn.Module, backend: Any, dtype: torch.dtype, device: Any) -> Optional[tuple]:
    """(apply, state) of a tied LM head on the backend's kernel for the embedding's own blocks (GGUF Q8_0 and the
    K-quants, whose tied embedding a Q4_K_M file stores as Q6_K), reading them in the file's mapping or in a copy the
    kernel repacked at load (the same bytes): no dense copy at all. None where the embedding is not such blocks or
    the backend has no kernel for them. The loader makes it right after the embedding, before the layers: a repack
    maps in the embedding's file pages (82 MB of a 1.7B Q4_K_M) until it ends, and with the layers resident those
    pages set the load's peak RSS."""
    if not _packed_tied_embedding(model) or model.embed_tokens.weight_type.name not in _BLOCK_HEAD_TYPES:
        return None
    e = model.embed_tokens
    kernel = backend.quantized_linear("gguf", e.weight_type.name)
    if kernel is None:
        return None
    with warnings.catch_warnings():  # the mapping is read-only; kernels only read their weights
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(e.blocks)
    weight = QuantizedWeight("gguf", e.weight_type.name, blocks, (e.num_embeddings, e.embedding_dim))
    state = kernel.prepare(weight, dtype, device)
    drop_unless_kept(e.blocks, blocks, state)  # a repacked head: lookups map back only the rows they read
    return kernel.apply, state


def _packed_tied_embedding(model: nn.Module) -> bool:
    return bool(getattr(model, "tie_word_embeddings", False)) and isinstance(getattr(model, "embed_tokens", None),
                                                                             QuantizedEmbedding)


def _lm_head(model: nn.Module, kernel: QuantizedLinearKernel, dtype: torch.dtype, device: Any) -> tuple:
    """(apply, state) of the LM head on ``kernel`` in ``dtype``. A tied GGUF-packed embedding is dequantized and
    packed a slice of the vocabulary at a time, logits concatenated: only the kernel's copy of the table is ever
    whole (a dense copy beside it was SmolLM2 Q4_1's peak RSS, +56 MB)."""
    if not _packed_tied_embedding(model):
        return kernel.apply, kernel.prepare(dense_weight(model.lm_head_weight.to(dtype)), dtype, device)
    states = []
    for part in model.embed_tokens.dequantize(dtype):
        states.append(kernel.prepare(dense_weight(part), dtype, device))
        trim_heap()  # each slice's transients, before the next slice's packed copy lands beyond them
    return (lambda sts, x, b: torch.cat([kernel.apply(st, x, b) for st in sts], dim=-1)), states
