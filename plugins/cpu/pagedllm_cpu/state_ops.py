"""Mamba2 and Gated DeltaNet state ops on the CPU: the reference's arithmetic (``pagedllm.backend.ssm_ops`` /
``delta_rule_ops``, whose docstrings are the contract) rearranged for the host.

- Decode (``selective_state_update``, ``fused_recurrent_gated_delta_rule``): each addressed slot of a float32 cache
  is updated in place through a view of its row, with batched matmuls over the heads (``baddbmm_`` for the
  outer-product write, ``bmm`` for the read-out): no gather, no scatter, no state-sized temporary (the reference
  makes several). Other cache dtypes go through one float32 copy of the addressed rows.
- Mamba2 prefill (``mamba_chunk_scan_combined``): the within-chunk decays are exponentiated differences of one
  cumulative sum, not transformers' ``segment_sum`` (a cumulative sum over the rows of an ``[l, l]`` expansion),
  and the C.B products are computed per B/C group, not per head.
- Both prefills run a sequence shorter than the chunk size as one chunk of its own length (the chunk size only
  tiles the work) instead of padding it to a whole chunk.
- Both prefills exponentiate log decays through :func:`exp_flushed`: a decay under ``exp(-80)`` (``1.8e-35``)
  becomes exactly 0 instead of a denormal float. Long chunks of strong decay are full of them (Mamba2's
  ``dt * A`` summed over a 256-token chunk reaches -100s, Qwen3-Next's ``g`` is often below -5 per token), and x86
  cores compute ``exp`` into denormals and multiply by them some 20x slower. The change to any result is below
  ``1e-34`` of its terms.

Measured against the reference in docs/cpu-backend.md.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F

from pagedllm.backend import delta_rule_ops, ssm_ops


#: Log decays below this are taken as -inf (see the module docstring): ``exp(-80)`` is still a normal float.
FLUSH_BELOW = -80.0


def exp_flushed(x: torch.Tensor) -> torch.Tensor:
    """``exp(x)``, exactly 0 where ``x < FLUSH_BELOW`` (never a denormal)."""
    return x.masked_fill(x < FLUSH_BELOW, -torch.inf).exp()


def _live(state_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = (state_indices >= 0).nonzero().squeeze(1)
    return rows, state_indices[rows].long()


def _slot_views(state: torch.Tensor, slots: torch.Tensor) -> tuple[Any, bool]:
    """The addressed states, float32, and whether they must be written back: a float32 cache is updated through
    views of its rows (no gather, no scatter), others through one float32 copy ``[b, ...]``."""
    if state.dtype == torch.float32:
        return [state[i] for i in slots.tolist()], False
    return state.index_select(0, slots).float(), True


def selective_state_update(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                           B: torch.Tensor, C: torch.Tensor, D: Optional[torch.Tensor], z: Optional[torch.Tensor],
                           dt_bias: Optional[torch.Tensor], dt_softplus: bool,
                           state_indices: torch.Tensor) -> torch.Tensor:
    rows, slots = _live(state_indices)
    heads, head_dim, d_state = state.shape[1:]
    xv = x[rows].float()
    dtv = ssm_ops.process_dt(dt[rows], dt_bias, dt_softplus)  # [b, h]
    rep = heads // B.shape[1]
    Bh = B[rows].float().repeat_interleave(rep, dim=1)[:, :, None, :]  # [b, h, 1, n]
    Ch = C[rows].float().repeat_interleave(rep, dim=1)[:, :, :, None]  # [b, h, n, 1]
    decay, dtx = torch.exp(dtv * A.float())[..., None, None], (dtv[..., None] * xv)[..., None]  # [b, h, 1|p, 1]
    states, copied = _slot_views(state, slots)
    y = torch.empty(len(rows), heads, head_dim, 1, device=x.device)
    for j, s in enumerate(states):  # [h, p, n] each: decay, write, read, in place
        s.mul_(decay[j]).baddbmm_(dtx[j], Bh[j])
        torch.bmm(s, Ch[j], out=y[j])
    if copied:
        state.index_copy_(0, slots, states.to(state.dtype))
    y = y.squeeze(-1)
    if D is not None:
        y.add_(xv * D.float()[:, None])
    if z is not None:
        y.mul_(F.silu(z[rows].float()))
    out = torch.zeros_like(x)
    out[rows] = y.to(x.dtype)
    return out


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, scale: Optional[float], state: torch.Tensor,
                                     state_indices: torch.Tensor, use_qk_l2norm_in_kernel: bool) -> torch.Tensor:
    rows, slots = _live(state_indices)
    v_heads, k_dim, v_dim = state.shape[1:]
    qh, kh = delta_rule_ops.prepare_qk(q[rows], k[rows], v_heads, scale, use_qk_l2norm_in_kernel)  # [b, HV, K]
    qh, kh = qh[:, :, None, :], kh[:, :, None, :]
    decay, vb, bb = torch.exp(g[rows].float())[..., None, None], v[rows].float()[:, :, None, :], beta[rows].float()
    states, copied = _slot_views(state, slots)
    out = torch.zeros_like(v)
    o = torch.empty(len(rows), v_heads, 1, v_dim, device=v.device)
    for j, s in enumerate(states):  # [HV, K, V] each, in place
        s.mul_(decay[j])
        delta = (vb[j] - torch.bmm(kh[j], s)) * bb[j][:, None, None]
        s.baddbmm_(kh[j].transpose(1, 2), delta)
        torch.bmm(qh[j], s, out=o[j])
    if copied:
        state.index_copy_(0, slots, states.to(state.dtype))
    out[rows] = o.squeeze(2).to(v.dtype)
    return out


def _ssd_one(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ssm_ops._ssd_one`` with ``B`` / ``C`` per group ``[L, g, n]`` and heads viewed as ``[g, r]``."""
    length, heads, head_dim = x.shape
    groups = B.shape[1]
    rep = heads // groups
    chunk_size = min(chunk_size, length)  # a short sequence is one chunk of its own length, not padded to a full one
    pad = -length % chunk_size
    c = (length + pad) // chunk_size
    xdt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad)).view(c, chunk_size, groups, rep, head_dim)
    a = F.pad(A * dt, (0, 0, 0, pad)).view(c, chunk_size, groups, rep)
    B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)).view(c, chunk_size, groups, -1) for t in (B, C))
    a_cum = a.permute(0, 2, 3, 1).cumsum(-1)  # [c, g, r, l]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()  # [l, s]: s <= l
    decay_ls = exp_flushed((a_cum[..., :, None] - a_cum[..., None, :]).masked_fill(~causal, -torch.inf))
    scores = torch.einsum("clgn,csgn->cgls", C, B)[:, :, None] * decay_ls
    xp = xdt.permute(0, 2, 3, 1, 4)  # [c, g, r, s, p]
    y = scores @ xp  # [c, g, r, l, p]
    decay_to_end = exp_flushed(a_cum[..., -1:] - a_cum)  # [c, g, r, l]
    chunk_states = torch.einsum("cgrlp,clgn->cgrpn", xp * decay_to_end[..., None], B)
    starts = torch.empty(c, groups, rep, head_dim, state.shape[-1], device=x.device)
    state = state.reshape(groups, rep, head_dim, -1)
    for i in range(c):
        starts[i] = state
        state = state * exp_flushed(a_cum[i, :, :, -1])[..., None, None] + chunk_states[i]
    y = y + torch.einsum("clgn,cgrpn->cgrlp", C, starts) * exp_flushed(a_cum)[..., None]
    y = y.permute(0, 3, 1, 2, 4).reshape(c * chunk_size, heads, head_dim)[:length]
    return y, state.reshape(heads, head_dim, -1)


def mamba_chunk_scan_combined(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                              chunk_size: int, cu_seqlens: torch.Tensor, initial_states: Optional[torch.Tensor],
                              D: Optional[torch.Tensor], z: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                              dt_softplus: bool, dt_limit: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    total, heads, head_dim = x.shape
    bounds = [int(v) for v in cu_seqlens.tolist()]
    dtp = ssm_ops.process_dt(dt, dt_bias, dt_softplus, tuple(dt_limit))
    a, xf, Bf, Cf = A.float(), x.float(), B.float(), C.float()
    y = torch.zeros(total, heads, head_dim, dtype=torch.float32, device=x.device)
    finals = torch.zeros(len(bounds) - 1, heads, head_dim, B.shape[-1], dtype=torch.float32, device=x.device)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = finals[i] if initial_states is None else initial_states[i].float()
        if end == start:
            finals[i] = init
            continue
        y[start:end], finals[i] = _ssd_one(xf[start:end], dtp[start:end], a, Bf[start:end], Cf[start:end], init,
                                           chunk_size)
    if D is not None:
        y.add_(xf * D.float()[:, None])
    if z is not None:
        y.mul_(F.silu(z.float()))
    return y.to(x.dtype), finals


def _delta_chunk_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``delta_rule_ops._chunk_one`` (same shapes, same WY form) with flushed decays."""
    heads, length = v.shape[0], v.shape[1]
    chunk_size = min(chunk_size, length)
    pad = -length % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    c = (length + pad) // chunk_size
    q, k, v = (t.reshape(heads, c, chunk_size, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, c, chunk_size), beta.reshape(heads, c, chunk_size)
    g_cum = g.cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = exp_flushed((g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(upper, -torch.inf))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay
    g_exp = exp_flushed(g_cum)[..., None]
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_read = torch.linalg.solve_triangular(system, k_beta * g_exp, upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec, k_dec = q * g_exp, k * exp_flushed(g_cum[..., -1:] - g_cum)[..., None]
    chunk_decay = exp_flushed(g_cum[..., -1])
    out = torch.empty_like(v)
    for i in range(c):
        u = new_v[:, i] - k_read[:, i] @ state
        out[:, i] = q_dec[:, i] @ state + attn[:, i] @ u
        state = state * chunk_decay[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, c * chunk_size, -1)[:, :length], state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           scale: Optional[float], initial_state: Optional[torch.Tensor], cu_seqlens: torch.Tensor,
                           use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    total, v_heads, v_dim = v.shape
    bounds = [int(x) for x in cu_seqlens.tolist()]
    qh, kh = delta_rule_ops.prepare_qk(q, k, v_heads, scale, use_qk_l2norm_in_kernel)
    qh, kh, vh = (t.transpose(0, 1) for t in (qh, kh, v.float()))
    gh, bh = g.float().t(), beta.float().t()
    out = torch.zeros(v_heads, total, v_dim, dtype=torch.float32, device=v.device)
    finals = torch.zeros(len(bounds) - 1, v_heads, k.shape[-1], v_dim, dtype=torch.float32, device=v.device)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = finals[i] if initial_state is None else initial_state[i].float()
        if end == start:
            finals[i] = init
            continue
        span = slice(start, end)
        out[:, span], finals[i] = _delta_chunk_one(qh[:, span], kh[:, span], vh[:, span], gh[:, span], bh[:, span],
                                                   init, delta_rule_ops.CHUNK_SIZE)
    return out.transpose(0, 1).to(v.dtype), finals
