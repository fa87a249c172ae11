"""A SIMULATED ``torch_npu`` for tests (never shipped): the ``npu`` device on CPU memory plus the vendor ops
``plugins/ascend`` calls, each with the signature vllm-ascend uses and core's reference semantics.

Importing it does what importing the real torch-npu does for a caller: ``torch.device("npu")`` works and
``torch.npu`` is the device module. Here the device is torch's pure-Python PrivateUse1 backend renamed ``npu``
(``_device.py``); tensors on it are wrappers around CPU tensors, and ops mixing ``npu`` and CPU tensors fail as on a
real device. ``__pagedllm_simulation__`` marks it; ``torch.npu.get_device_name`` says "simulated".
"""

from __future__ import annotations

from torch_npu import _device, npu  # noqa: F401  (sets up the device and torch.npu)
from torch_npu._ops import (_npu_paged_attention, _npu_paged_attention_get_workspace,  # noqa: F401
                            _npu_reshape_and_cache,
                            npu_fused_infer_attention_score, npu_fusion_attention, npu_rms_norm,
                            npu_swiglu)

__version__ = "2.13.0+pagedllm.sim"
__pagedllm_simulation__ = True
