"""What llama.cpp's converter does to the tensors of the stateful archs it writes, undone when reading them
(``gguf_weights.GGUFWeights``), so the native models get HF's tensors:

- ``lfm2`` (``LFM2Model``): the depthwise short conv ``[dim, 1, L]`` squeezed to ``[dim, L]``.
- ``mamba2`` (``Mamba2Model``): the conv ``[conv_dim, 1, K]`` squeezed to ``[conv_dim, K]``; ``A_log`` stored as
  ``A = -exp(A_log)`` and, like ``D``, as ``[heads, 1]``; the gated norm ``[d_inner]`` as ``[n_groups, d_inner /
  n_groups]``; ``dt_bias`` renamed ``dt_proj.bias`` before the name map (``ssm_dt.bias``).

Qwen3.5's and Qwen3-Next's (``qwen35`` / ``qwen35moe`` / ``qwen3next``) are undone by ``gguf_qwen35.py``.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

#: GGUF architectures whose tensors are transformed here
STATEFUL_GGUF_ARCHS = ("lfm2", "mamba2")


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
