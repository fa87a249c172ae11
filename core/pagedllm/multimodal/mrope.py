"""M-RoPE (Qwen2-VL, Qwen2.5-VL): 3-D rotary positions (temporal, height, width) per prompt token.

Text tokens sit on the diagonal (the same position on all three axes); an image's placeholder tokens take the
grid of its merged patches, starting at the position after the text before it (``t = start``, ``h = start + row``,
``w = start + column``), and the text after an image continues from ``start + max(rows, columns)`` -- so positions
run behind token indices. Generated tokens continue on the diagonal: ``index + delta`` on every axis, with ``delta =
max position + 1 - prompt length`` (transformers' ``get_rope_index`` / ``rope_deltas``).

The positions are computed once per request at ``add_request`` (:func:`mrope_positions`, from the image grids the
processor gave), kept on the request (``Request.mrope_positions``) and sliced per step by the model runner
(:func:`step_mrope_positions`): a chunk that splits an image takes its slice, so chunked prefill keeps them right.
The model reads the 3-D positions of a step that has any off-diagonal token from ``meta.extra["mrope_positions"]``;
the plain ``positions`` tensor carries the diagonal value (exact for every text and generated token), so decode
steps and text-only steps run through the backend's graphs unchanged.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch


def mrope_positions(num_tokens: int, features: Sequence[Any], merge: int) -> tuple[np.ndarray, int]:
    """``([3, num_tokens] int64 positions, delta)`` of a prompt whose images are ``features`` (each with
    ``extra["grid_thw"]``, in prompt order)."""
    pos = np.empty((3, num_tokens), dtype=np.int64)
    cur, at = 0, 0
    for f in sorted(features, key=lambda f: f.mm_position.offset):
        off, n = f.mm_position.offset, f.mm_position.length
        pos[:, at:off] = np.arange(cur, cur + off - at)
        cur += off - at
        t, h, w = (int(x) for x in f.extra["grid_thw"])
        h, w = h // merge, w // merge
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        grid = np.stack([tt, hh, ww]).reshape(3, -1) + cur
        if grid.shape[1] != n:
            raise ValueError(f"image at token {off}: grid {t}x{h}x{w} has {grid.shape[1]} tokens, the prompt {n}")
        pos[:, off:off + n] = grid
        cur += max(h, w)
        at = off + n
    pos[:, at:] = np.arange(cur, cur + num_tokens - at)
    return pos, int(pos.max()) + 1 - num_tokens if num_tokens else 0


def step_mrope_positions(requests: Sequence[Any], pos: np.ndarray,
                         row: np.ndarray) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """The step's model positions for token indices ``pos`` of ``requests[row]``: (diagonal ``[T]``, and
    ``[3, T]`` when a token is off the diagonal, else None). Requests without images keep their indices."""
    out = np.repeat(pos[None], 3, axis=0)
    for i, r in enumerate(requests):
        m = getattr(r, "mrope_positions", None)
        if m is None:
            continue
        table, delta = m
        sel = np.nonzero(row == i)[0]
        p = pos[sel]
        inside = p < table.shape[1]
        out[:, sel[inside]] = table[:, p[inside]]
        out[:, sel[~inside]] = p[~inside] + delta
    diag = out[0].copy()
    return diag, (out if (out != out[0:1]).any() else None)


def mrope_cos_sin(cos_sin_cache: torch.Tensor, positions: torch.Tensor, section: Sequence[int]) -> torch.Tensor:
    """``[T, rot_dim]`` rotary table of a step's tokens (the backend rotary layout: cat(cos, sin) over the half-dim)
    for 3-D ``positions [3, T]``: frequency ``j`` takes its angle from axis ``i`` of ``mrope_section`` (HF's
    recomposition). Used with positions ``0..T-1`` through the backend's rotary hook."""
    half = cos_sin_cache.shape[-1] // 2
    axis = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(list(section)))
    if axis.numel() != half:
        raise ValueError(f"mrope_section {list(section)} covers {axis.numel()} of {half} rotary frequencies")
    axis = torch.cat((axis, axis)).to(positions.device)  # cos and sin halves
    rows = cos_sin_cache[positions.long()]  # [3, T, rot]
    return rows.gather(0, axis.view(1, 1, -1).expand(1, rows.shape[1], -1))[0]
