"""Hand a loaded model's dense linear layers to the backend's dense kernel, when it has one.

vLLM treats unquantized weights as one more linear method (``UnquantizedLinearMethod``) whose CPU version repacks
each weight once for oneDNN; here the same question goes through the same hook as quantized weights:
``pagedllm_quantized_linear("unquantized", <dtype name>)``. A backend without a dense kernel answers ``None`` and
the model keeps ``nn.Linear`` (``F.linear``) unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.hookspec import QuantizedLinearKernel, QuantizedWeight


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
    LM head (a copy: the tied embedding and ``lm_head_weight`` stay as they are). Returns how many were swapped.

    ``quantized``: the decoder's linears all run on the backend's quantized kernels, not core's exact reference
    (the CPU's take bf16 activations); a float32 LM
    head then runs in bf16 where the backend has a bf16 dense kernel, halving the bytes the largest single matrix
    streams per token (SmolLM2's tied 49152 x 576 head was a quarter of a Q4_1 batch-1 step in fp32)."""
    head_kernel = None
    if quantized and dtype == torch.float32:
        head_kernel = backend.quantized_linear("unquantized", "bfloat16")
    kernel = backend.quantized_linear("unquantized", str(dtype).removeprefix("torch."))
    if head_kernel is not None:
        bf16 = head_kernel
        state = bf16.prepare(dense_weight(model.lm_head_weight.to(torch.bfloat16)), torch.bfloat16, device)
        model.lm_head_kernel = (lambda st, x, b: bf16.apply(st, x.to(torch.bfloat16), b).to(x.dtype), state)
    if kernel is None:
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
    head = model.lm_head_weight
    if head.dtype == dtype and model.lm_head_kernel is None:
        weight = dense_weight(head)
        model.lm_head_kernel = (kernel.apply, kernel.prepare(weight, dtype, device))
    return swapped
