"""Mamba2's state ops in pure torch: the one-token state update and the chunked scan (SSD), core's reference for
``pagedllm_selective_state_update`` / ``pagedllm_mamba_chunk_scan_combined`` and the conformance oracle.

vLLM's names and semantics (``vllm/model_executor/layers/mamba/ops/mamba_ssm.py`` and ``ssd_combined.py``) in the
engine's flat token layout, with Mamba2's per-head parameters (vLLM's ``TIE_HDIM`` form: ``dt``, ``A``, ``D`` and
``dt_bias`` one value per head; a kernel that wants vLLM's ``[heads, head_dim(, d_state)]`` views expands them with
stride 0). Shapes: ``h`` heads of ``p`` = head_dim channels, ``g`` groups of B/C (head ``i`` reads group
``i // (h // g)``), ``n`` = d_state.

- ``dt`` is first ``dt + dt_bias``, then ``softplus`` when ``dt_softplus`` (torch's, linear above 20 as vLLM's
  kernels), then (chunked scan only) clamped to ``dt_limit``.
- Per token and head: ``state = state * exp(dt * A) + dt * x (outer) B``; ``y = state @ C + D * x``; with ``z``,
  ``y = y * silu(z)``. ``A`` is negative (``-exp(A_log)``).
- Arithmetic is float32 whatever the input dtypes; outputs come back in ``x``'s dtype, new states in the state
  cache's dtype (``selective_state_update``) or float32 (``mamba_chunk_scan_combined``'s final states).

``selective_state_update`` (decode, one token per sequence) updates the state cache ``[num_slots, h, p, n]`` in
place at ``state_indices`` (int ``[batch]``; -1, vLLM's ``PAD_SLOT_ID``, is a padding row: its state is neither read
nor written and its output is zero). Two rows never share a slot. Every other slot is left untouched.

``mamba_chunk_scan_combined`` (prefill; vLLM's ``mamba_chunk_scan_combined_varlen``) runs a flat chunk of tokens
``[T, ...]`` split into sequences by ``cu_seqlens`` (int ``[N + 1]``, from 0), sequence ``i`` starting from
``initial_states[i]`` (``[N, h, p, n]``; ``None``: every sequence starts from zeros, as a fresh one does), and
returns ``(out [T, h, p], final_states [N, h, p, n] float32)``. It is functional: the caller gathers the initial
states from its slots (zeros for fresh sequences) and writes the final ones back. ``chunk_size`` only tiles the
work: any chunk size gives the same result, and so does running a sequence in several calls with the state carried.

Oracle: transformers' ``mamba2_selective_state_update`` / ``mamba2_chunk_scan`` (``models/mamba2/modeling_mamba2.py``,
its ``segment_sum`` form of SSD), compared in ``tests/core/test_ssm_ops.py``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def process_dt(dt: torch.Tensor, dt_bias: Optional[torch.Tensor], dt_softplus: bool,
               dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """Mamba2's time step in float32: bias, softplus, clamp (the order of vLLM's and transformers' kernels)."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    if dt_limit != (0.0, float("inf")):
        dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., groups, n]`` -> ``[..., heads, n]`` float32: head i reads group i // (heads // groups)."""
    return t.float().repeat_interleave(heads // t.shape[-2], dim=-2)


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor] = None,
                           z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                           dt_softplus: bool = False,
                           state_indices: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode token per sequence (see the module docstring). ``state`` ``[num_slots, h, p, n]`` (in place);
    ``x`` / ``z`` ``[batch, h, p]``; ``dt`` ``[batch, h]``; ``A`` / ``D`` / ``dt_bias`` ``[h]``; ``B`` / ``C``
    ``[batch, g, n]``; ``state_indices`` int ``[batch]`` (``None``: row i uses slot i). Returns ``[batch, h, p]`` in
    ``x``'s dtype."""
    batch, heads = x.shape[0], x.shape[1]
    if state_indices is None:
        state_indices = torch.arange(batch, device=x.device)
    rows = (state_indices >= 0).nonzero().squeeze(1)
    slots = state_indices[rows].long()
    s = state[slots].float()  # [b, h, p, n]
    xv = x[rows].float()
    dtv = process_dt(dt[rows], dt_bias, dt_softplus)  # [b, h]
    decay = torch.exp(dtv * A.float())[..., None, None]
    s = s * decay + (dtv[..., None] * xv)[..., None] * _per_head(B[rows], heads)[:, :, None, :]
    state[slots] = s.to(state.dtype)
    y = (s * _per_head(C[rows], heads)[:, :, None, :]).sum(-1)  # [b, h, p]
    if D is not None:
        y = y + xv * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z[rows].float())
    out = torch.zeros_like(x)
    out[rows] = y.to(x.dtype)
    return out


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """``[..., T]`` -> ``[..., T, T]``: ``out[i, j] = x[j+1] + ... + x[i]`` for ``i >= j``, else -inf (the log of
    the decay from position j to i). transformers' stable form: masked cumulative sums, no differences."""
    t = x.size(-1)
    x = x[..., None].expand(*x.size(), t)
    x = x.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), -1), 0)
    out = torch.cumsum(x, dim=-2)
    return out.masked_fill(~torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device)), -torch.inf)


def _ssd_one(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SSD over one sequence, all float32: ``x`` ``[L, h, p]``, ``dt`` ``[L, h]`` (processed), ``B`` / ``C``
    ``[L, h, n]`` (per head), ``state`` ``[h, p, n]``. Returns ``(y [L, h, p]`` without ``D`` and ``z``, final
    state)."""
    length = x.shape[0]
    pad = -length % chunk_size
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))  # zero padding: no input, no decay (A*dt = 0)
    a = F.pad(A * dt, (0, 0, 0, pad))
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (B, C))
    c = (length + pad) // chunk_size
    xdt, B, C = (t.reshape(c, chunk_size, *t.shape[1:]) for t in (xdt, B, C))  # [c, l, h, .]
    a = a.reshape(c, chunk_size, -1).permute(2, 0, 1)  # [h, c, l]
    a_cum = torch.cumsum(a, dim=-1)
    # 1. within each chunk: attention-like, causal, decayed from source s to target l
    decay_ls = torch.exp(segment_sum(a))  # [h, c, l, s]
    y = torch.einsum("clhn,cshn,hcls,cshp->clhp", C, B, decay_ls, xdt)
    # 2. what each chunk adds to the state by its end
    decay_to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [h, c, l]
    chunk_states = torch.einsum("clhn,hcl,clhp->chpn", B, decay_to_end, xdt)
    # 3. the state entering each chunk, carried from the initial state
    starts = []
    for k in range(c):
        starts.append(state)
        state = state * torch.exp(a_cum[:, k, -1])[:, None, None] + chunk_states[k]
    # 4. what the entering state contributes to each position
    y = y + torch.einsum("clhn,chpn,hcl->clhp", C, torch.stack(starts), torch.exp(a_cum))
    return y.reshape(c * chunk_size, *y.shape[2:])[:length], state


def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                              C: torch.Tensor, chunk_size: int, cu_seqlens: Optional[torch.Tensor] = None,
                              initial_states: Optional[torch.Tensor] = None, D: Optional[torch.Tensor] = None,
                              z: Optional[torch.Tensor] = None, dt_bias: Optional[torch.Tensor] = None,
                              dt_softplus: bool = False,
                              dt_limit: tuple[float, float] = (0.0, float("inf")),
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk of sequences (see the module docstring). ``x`` / ``z`` ``[T, h, p]``; ``dt`` ``[T, h]``;
    ``A`` / ``D`` / ``dt_bias`` ``[h]``; ``B`` / ``C`` ``[T, g, n]``; ``cu_seqlens`` int ``[N + 1]`` (``None``: one
    sequence); ``initial_states`` ``[N, h, p, n]`` or ``None`` (zeros). Returns ``(out [T, h, p]`` in ``x``'s dtype,
    ``final_states [N, h, p, n]`` float32)."""
    total, heads, head_dim = x.shape
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, total])
    bounds = [int(v) for v in cu_seqlens.tolist()]
    n_seq, d_state = len(bounds) - 1, B.shape[-1]
    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit)
    a = A.float()
    Bh, Ch, xf = _per_head(B, heads), _per_head(C, heads), x.float()
    y = torch.zeros(total, heads, head_dim, dtype=torch.float32, device=x.device)
    finals = torch.zeros(n_seq, heads, head_dim, d_state, dtype=torch.float32, device=x.device)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = finals[i] if initial_states is None else initial_states[i].float()
        if end == start:
            finals[i] = init
            continue
        y[start:end], finals[i] = _ssd_one(xf[start:end], dtp[start:end], a, Bh[start:end], Ch[start:end], init,
                                           chunk_size)
    if D is not None:
        y = y + xf * D.float()[:, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype), finals
