"""Tensor-parallel layers (vLLM's names): each rank holds a slice of the weight and one collective makes the result
whole. Column-parallel linears need no module of their own: a fused ``qkv_proj`` / ``gate_up_proj`` whose rows were
sliced at load (``sharding.py``) is a plain ``nn.Linear`` with fewer outputs, and attention / the activation run on
the local heads / columns. These are the ones that communicate.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Linear):
    """``o_proj`` / ``down_proj``: input features split across ranks; the partial products are all-reduced, then the
    (unsplit) bias is added once. The local product runs on the backend's dense kernel when the loader hands one
    over (:meth:`use_dense_kernel`), the kernel every other linear of the model runs on, else on ``F.linear``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, comm: Any):
        super().__init__(in_features, out_features, bias=bias)
        self.comm = comm
        self.dense: Optional[tuple[Callable[..., torch.Tensor], Any]] = None  # (kernel.apply, packed state)

    def use_dense_kernel(self, apply: Callable[..., torch.Tensor], state: Any) -> None:
        """Run the local product as ``apply(state, x, None)``; the unpacked weight is dropped (the kernel's copy is
        the one kept, as ``DenseKernelLinear`` does at one rank)."""
        self.dense = (apply, state)
        self.weight = None  # type: ignore[assignment]

    def local_product(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum ``x @ W_r^T`` (no bias)."""
        if self.dense is not None:
            apply, state = self.dense
            return apply(state, x, None)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(self.local_product(x))
        return y.add_(self.bias) if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dense_kernel={self.dense is not None}"


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * per_rank, (rank + 1) * per_rank)`` of the vocabulary (the last rank's slice zero-padded when the
    vocabulary does not divide); ids of other ranks' rows give zeros, the all-reduce fills them in."""

    def __init__(self, per_rank: int, hidden_size: int, rank: int, comm: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(per_rank, hidden_size), requires_grad=False)
        self.per_rank, self.start, self.comm = per_rank, rank * per_rank, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out)


class LogitsGather:
    """The vocab-parallel LM head's second half: every rank's ``[N, per_rank]`` logits gathered in rank order, the
    padding columns dropped (``CausalLM.logits_gather``)."""

    def __init__(self, vocab_size: int, comm: Any):
        self.vocab_size, self.comm = vocab_size, comm

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(logits, dim=-1)[..., : self.vocab_size]


class ExpertParallelMoE:
    """Expert parallel (``--enable-expert-parallel``): this rank holds experts ``[start, start + num_local)`` and
    runs the backend's ``fused_moe`` on the routes that land there; the other routes get weight 0 (on local expert
    0: wasted work, not a wrong result), and the all-reduce adds every rank's experts. Replaces a
    ``SparseMoeBlock``'s ``fused_moe``; the router stays whole on every rank."""

    def __init__(self, fused_moe: Any, start: int, num_local: int, comm: Any):
        self.fused_moe, self.start, self.num_local, self.comm = fused_moe, start, num_local, comm

    def __call__(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor) -> torch.Tensor:
        local = topk_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = self.fused_moe(x, w13, w2, topk_weights.masked_fill(outside, 0), local.masked_fill(outside, 0))
        return self.comm.all_reduce(out)


class PPMissingLayer(nn.Identity):
    """A decoder layer another pipeline stage owns: no weights here."""
