"""What llama.cpp's Qwen3.5 converter (``Qwen3_5TextModel`` / ``Qwen3_5MoeTextModel`` over
``_LinearAttentionVReorderBase`` and ``Qwen3NextModel``) does to the tensors, undone when reading them
(``gguf_weights.GGUFWeights``), so ``models/qwen3_next.py`` gets HF's tensors:

- every ``*norm.weight`` but the gated ``linear_attn.norm`` (``ssm_norm``) is stored as ``w + 1`` (HF keeps the
  zero-centred ``w`` and computes ``1 + w``): 1 is subtracted back;
- ``A_log`` is stored as ``A = -exp(A_log)`` (``ssm_a``) and ``dt_bias`` renamed ``dt_proj.bias`` (``ssm_dt.bias``);
- the depthwise conv ``[conv_dim, 1, K]`` is squeezed to ``[conv_dim, K]``;
- where there are fewer key heads than value heads, the value heads are reordered from HF's grouped-by-key-head
  order (``k0v0 k0v1 k1v0 k1v1``) to ggml's tiled broadcast order (``k0v0 k1v0 k0v1 k1v1``): the rows of
  ``in_proj_z`` (``attn_gate``), ``in_proj_a`` / ``in_proj_b`` (``ssm_alpha`` / ``ssm_beta``), ``A_log``,
  ``dt_bias``, the value rows of ``in_proj_qkv`` (``attn_qkv``) and of the conv, and the columns of ``out_proj``
  (``ssm_out``). Row orders are undone on packed blocks too (a row permutation never splits a block); ``ssm_out``'s
  column order crosses blocks, so it is read dense (:func:`column_order`).

Qwen3-Next (``qwen3next``, ``Qwen3NextModel``) gets the same norm, ``A``, ``dt_bias`` and conv transforms but no
value-head reorder; its fused ``in_proj_qkvz`` (``[q, k, v, z]`` per key head) is split into ``attn_qkv`` (all q, all
k, all v) and ``attn_gate`` (all z), put back together by :meth:`Qwen35Layout.fuse_qkvz`; ``in_proj_ba`` is written as
it is (``ssm_ba``). Its config is built from the metadata by ``gguf_archs.qwen3next_config``.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

#: GGUF architectures whose tensors are transformed here
QWEN35_GGUF_ARCHS = ("qwen35", "qwen35moe", "qwen3next")


def converter_name(hf_name: str) -> str:
    """The HF name the converter passed to gguf's name map for ``hf_name`` (``dt_bias`` became ``dt_proj.bias``)."""
    if hf_name.endswith(".linear_attn.dt_bias"):
        return hf_name.removesuffix(".dt_bias") + ".dt_proj.bias"
    return hf_name


def _tiled_to_grouped(num_k_heads: int, per_k: int, head_dim: int) -> np.ndarray:
    """Index into the tiled axis for each grouped position: ``grouped = tiled[order]``."""
    tiled_of_grouped = np.arange(num_k_heads * per_k * head_dim).reshape(per_k, num_k_heads, head_dim)
    return tiled_of_grouped.transpose(1, 0, 2).reshape(-1)


class Qwen35Layout:
    """The converter's transforms for one file: ``arch`` and the config's head counts (the value-head reorder only
    for Qwen3.5 with ``linear_num_key_heads`` < ``linear_num_value_heads``)."""

    def __init__(self, config: Any, arch: str):
        nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.per_k = nv // nk if arch != "qwen3next" and nk and nv != nk else 1
        self.nk, self.dk, self.dv = nk, config.linear_key_head_dim, config.linear_value_head_dim
        self.nv = nv
        self.qk_rows = 2 * config.linear_key_head_dim * nk  # q and k rows of in_proj_qkv and the conv

    def _order(self, head_dim: int, offset: int = 0) -> Optional[np.ndarray]:
        if self.per_k == 1:
            return None
        return np.concatenate([np.arange(offset), offset + _tiled_to_grouped(self.nk, self.per_k, head_dim)])

    def row_order(self, gguf_name: str) -> Optional[np.ndarray]:
        """The row order undoing the value-head reorder of tensor ``gguf_name`` (None: rows already in HF order)."""
        if not gguf_name.startswith("blk."):
            return None
        kind = gguf_name.split(".")[2]
        if kind in ("attn_qkv", "ssm_conv1d"):
            return self._order(self.dv, self.qk_rows)
        if kind == "attn_gate":
            return self._order(self.dv)
        if kind in ("ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            return self._order(1)
        return None

    def column_order(self, gguf_name: str) -> Optional[np.ndarray]:
        """The column order undoing the reorder of ``out_proj``'s inputs (None for every other tensor)."""
        return self._order(self.dv) if gguf_name.endswith(".ssm_out.weight") else None

    def undo(self, gguf_name: str, data: np.ndarray) -> np.ndarray:
        """``data`` (dense float32, as the file holds tensor ``gguf_name``) with the value transforms undone (norm
        offset, ``A``, the conv's squeeze, ``out_proj``'s columns); rows are :meth:`row_order`'s."""
        if gguf_name.endswith("norm.weight") and not gguf_name.endswith("ssm_norm.weight"):
            return data - 1
        if gguf_name.endswith(".ssm_a"):
            return np.log(-data)
        if gguf_name.endswith("ssm_conv1d.weight") and data.ndim == 2:
            return data[:, None]
        cols = self.column_order(gguf_name)
        return data if cols is None else data[:, cols]

    def fuse_qkvz(self, qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
        """Qwen3-Next's ``in_proj_qkvz`` (``[q, k, v, z]`` per key head) from ``attn_qkv`` and ``attn_gate``."""
        h, vk = qkv.shape[-1], self.nv // self.nk * self.dv  # value rows per key head
        q, k = (qkv[i * self.nk * self.dk:(i + 1) * self.nk * self.dk].reshape(self.nk, self.dk, h) for i in (0, 1))
        v = qkv[self.qk_rows:].reshape(self.nk, vk, h)
        return np.concatenate([q, k, v, z.reshape(self.nk, vk, h)], axis=1).reshape(-1, h)
