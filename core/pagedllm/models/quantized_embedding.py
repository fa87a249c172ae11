"""A GGUF token embedding left as the file's blocks, in the file's mapping: a lookup dequantizes only its rows.

GGUF files store ``token_embd`` block-quantized (SmolLM2's Q4_1 file: Q8_0, 29 MB, where the float32 table is
113 MB). Blocks run along a row, so a row's bytes dequantize on their own, with ``gguf.quants`` (the format's
oracle), to exactly the values the whole table would have. The blocks are not copied: like llama.cpp's mmap, only
the pages of rows looked up become resident (file-backed, reclaimable). A tied LM head runs on the backend's kernel
for these blocks where it has one (CPU: Q8_0), reading them in place; else the loader builds a dense table once from
``dequantize`` (models/dense_linears.py) in the head kernel's dtype, a slice at a time.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch
from torch import nn

from pagedllm.models.gguf_weights import GGUFWeights, drop_pages
from pagedllm.models.weights import checkpoint_prefix


class QuantizedEmbedding(nn.Module):
    """``nn.Embedding`` over GGUF rows (``blocks``: the file's read-only ``[num_embeddings, row bytes]`` uint8 map);
    lookups return ``dtype`` on ``device``."""

    def __init__(self, blocks: np.ndarray, weight_type: Any, embedding_dim: int, dtype: torch.dtype, device: Any):
        super().__init__()
        self.blocks, self.weight_type = blocks, weight_type  # gguf.GGMLQuantizationType
        self.num_embeddings, self.embedding_dim = blocks.shape[0], embedding_dim
        self.dtype, self.device = dtype, torch.device(device)

    def _dense(self, rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        from gguf.quants import dequantize  # heavy: gguf

        dense = np.asarray(dequantize(rows, self.weight_type), dtype=np.float32)
        return torch.from_numpy(dense).to(device=self.device, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[input_ids.reshape(-1).cpu().numpy()]
        return self._dense(rows, self.dtype).reshape(*input_ids.shape, self.embedding_dim)

    def dequantize(self, dtype: torch.dtype, rows: int = 8192) -> Iterator[torch.Tensor]:
        """The whole table in ``dtype``, ``rows`` rows at a time, each dequantized through float32 1024 rows at a
        time (small transients), its file pages unmapped once read."""
        for i in range(0, self.num_embeddings, rows):
            out = torch.empty(min(rows, self.num_embeddings - i), self.embedding_dim, dtype=dtype, device=self.device)
            for j in range(0, out.shape[0], 1024):
                part = self.blocks[i + j:i + j + 1024]
                out[j:j + 1024] = self._dense(part, dtype)
                drop_pages(part)
            yield out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, gguf:{self.weight_type.name}"


def quantize_embedding(model: nn.Module, weights: Any, dtype: torch.dtype, device: Any) -> bool:
    """Swap ``model.embed_tokens`` for a ``QuantizedEmbedding`` when ``weights`` is a GGUF file storing it as
    blocks; returns whether it did."""
    embed = getattr(model, "embed_tokens", None)
    if not isinstance(weights, GGUFWeights) or not isinstance(embed, nn.Embedding):
        return False
    t = weights.blocks(checkpoint_prefix(weights) + "embed_tokens.weight")
    if t is None:
        return False
    model.embed_tokens = QuantizedEmbedding(t.data, t.tensor_type, embed.embedding_dim, dtype, device)
    return True
