"""What llama.cpp's converter does to the tensors of the stateful archs it writes, undone when reading them
(``gguf_weights.GGUFWeights``), so the native models get HF's tensors:

- ``lfm2`` (``LFM2Model``): the depthwise short conv ``[dim, 1, L]`` squeezed to ``[dim, L]``.
- ``mamba2`` (``Mamba2Model``): the conv ``[conv_dim, 1, K]`` squeezed to ``[conv_dim, K]``; ``A_log`` stored as
  ``A = -exp(A_log)`` and, like ``D``, as ``[heads, 1]``; the gated norm ``[d_inner]`` as ``[n_groups, d_inner /
  n_groups]``; ``dt_bias`` renamed ``dt_proj.bias`` before the name map (``ssm_dt.bias``).

Dense Qwen3.5 (``qwen35``) is undone by ``gguf_qwen35.py``; Qwen3.5-MoE files (``qwen35moe``) get a config from
transformers' GGUF reader, but their expert tensors are not mapped and tested yet: they are refused at load
(:data:`REFUSED_GGUF_ARCHS`) rather than run wrong.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

#: GGUF architectures whose tensors are transformed here
STATEFUL_GGUF_ARCHS = ("lfm2", "mamba2")
#: Stateful GGUF architectures that would load with llama.cpp's transforms still applied: why each is refused
REFUSED_GGUF_ARCHS = dict.fromkeys(
    ("qwen35moe",),
    "llama.cpp's Qwen3.5 converter stores zero-centred norms as w + 1, A_log as -exp(A_log) and the Gated DeltaNet "
    "value heads tiled instead of grouped; pagedllm does not undo these yet, so the file would run wrong (load the "
    "safetensors checkpoint instead)")


def converter_name(arch: str, hf_name: str) -> str:
    """The HF name the converter passed to gguf's name map for ``hf_name`` (Mamba2's ``dt_bias``)."""
    if arch == "mamba2" and hf_name.endswith(".dt_bias"):
        return hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    return hf_name


def undo_converter(arch: str, gguf_name: str, data: np.ndarray) -> Optional[np.ndarray]:
    """``data`` (dense float32, as the file holds tensor ``gguf_name``) in HF's shape and meaning; None when the
    converter left it as it was."""
    if arch not in STATEFUL_GGUF_ARCHS:
        return None
    if gguf_name.endswith(("shortconv.conv.weight", "ssm_conv1d.weight")) and data.ndim == 2:
        return data[:, None]  # the depthwise conv's middle dimension back
    if arch != "mamba2":
        return None
    if gguf_name.endswith(".ssm_a"):
        return np.log(-data.reshape(-1))  # A = -exp(A_log)
    if gguf_name.endswith((".ssm_d", "ssm_norm.weight")):
        return data.reshape(-1)
    return None
