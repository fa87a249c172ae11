"""Pure-torch reference of the recurrent-state hooks (contract v3): the state allocator and the causal conv1d of
LFM2's short convolutions (Mamba2 layers use the same two ops), token-major like the rest of the flat batch.

These are the conformance oracle and the fallback of every backend that leaves the hooks to core. The prefill op
loops over sequences (one ``F.conv1d`` each); the decode op is one gather, multiply-sum and scatter for the batch.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from pagedllm.backend.hookspec import MambaSpec

ACTIVATIONS = (None, "silu")


def allocate_state_cache(spec: MambaSpec) -> list:
    """Contiguous zeros: per layer, one ``[num_slots, *shape]`` tensor per state entry."""
    return [tuple(torch.zeros((spec.num_slots, *shape), dtype=dtype, device=spec.device)
                  for shape, dtype in zip(spec.shapes, spec.dtypes)) for _ in range(spec.num_layers)]


def _act(out: torch.Tensor, activation: Optional[str]) -> torch.Tensor:
    if activation is None:
        return out
    if activation == "silu":
        return F.silu(out)
    raise ValueError(f"activation: causal conv1d supports {ACTIVATIONS}, got {activation!r}")


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], conv_states: torch.Tensor,
                     query_start_loc: torch.Tensor, state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                     activation: Optional[str] = None) -> torch.Tensor:
    """Prefill chunks of many sequences (see ``hookspec.pagedllm_causal_conv1d_fn``): each sequence's rows after its
    slot's state (or zeros), convolved; the slot then holds the last ``width - 1`` inputs."""
    width = weight.shape[1]
    out = torch.zeros_like(x)
    qsl = query_start_loc.tolist()
    slots = state_indices.tolist()
    init = has_initial_state.tolist()
    w = weight.unsqueeze(1)  # [dim, 1, width]: a depthwise conv1d
    for i, slot in enumerate(slots):
        lo, hi = qsl[i], qsl[i + 1]
        if slot < 0 or hi <= lo:
            continue
        prev = (conv_states[slot].to(x.dtype) if init[i]
                else x.new_zeros((x.shape[1], width - 1)))  # [dim, width - 1]
        seq = torch.cat((prev, x[lo:hi].t()), dim=1)  # [dim, width - 1 + n]
        y = F.conv1d(seq.unsqueeze(0).to(weight.dtype), w, bias, groups=x.shape[1])[0]  # [dim, n]
        out[lo:hi] = _act(y, activation).t().to(x.dtype)
        conv_states[slot] = seq[:, seq.shape[1] - (width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor], activation: Optional[str],
                         state_indices: torch.Tensor) -> torch.Tensor:
    """One token per sequence (see ``hookspec.pagedllm_causal_conv1d_update``), vectorised over the batch."""
    keep = state_indices >= 0
    out = torch.zeros_like(x)
    if not bool(keep.any()):
        return out
    rows = keep.nonzero().squeeze(1)
    slots = state_indices[rows].long()
    window = torch.cat((conv_states[slots].to(x.dtype), x[rows].unsqueeze(-1)), dim=-1)  # [b, dim, width]
    y = (window.to(weight.dtype) * weight).sum(-1)
    if bias is not None:
        y = y + bias
    out[rows] = _act(y, activation).to(x.dtype)
    conv_states[slots] = window[..., 1:].to(conv_states.dtype)
    return out
