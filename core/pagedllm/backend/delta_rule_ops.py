"""The gated delta rule (Gated DeltaNet: Qwen3-Next, Qwen3.5) in pure torch: chunked prefill and recurrent decode,
core's reference for ``pagedllm_chunk_gated_delta_rule`` / ``pagedllm_fused_recurrent_gated_delta_rule`` and the
conformance oracle.

flash-linear-attention's names and semantics (``fla.ops.gated_delta_rule``, vendored by vLLM in
``vllm/model_executor/layers/fla/ops``) in the engine's flat token layout: FLA's varlen form with its leading batch
of 1 dropped. Shapes: ``H`` query/key heads of ``K`` channels, ``HV`` value heads of ``V`` channels (``HV`` a
multiple of ``H``: value head ``i`` reads query/key head ``i // (HV // H)``); the state of one sequence is
``[HV, K, V]`` (FLA's layout).

Per token, per value head, with ``q`` and ``k`` first L2-normalised when ``use_qk_l2norm_in_kernel``
(``x / sqrt(sum(x^2) + 1e-6)``, FLA's) and ``q`` then multiplied by ``scale`` (``None``: ``K ** -0.5``)::

    S = S * exp(g)                          # g: log decay, <= 0
    S = S + k (outer) (beta * (v - k @ S))  # the delta rule: write the correction of what S predicts for k
    o = q @ S

Arithmetic is float32 whatever the input dtypes; outputs come back in ``v``'s dtype.

``fused_recurrent_gated_delta_rule`` (decode, one token per sequence) updates the state cache ``[num_slots, HV, K,
V]`` in place at ``state_indices`` (int ``[batch]``; -1 is a padding row: its state is neither read nor written and
its output is zero; two rows never share a slot; other slots are untouched), storing in the cache's dtype. vLLM
calls it with ``inplace_final_state=True`` and ``ssm_state_indices``.

``chunk_gated_delta_rule`` (prefill) runs a flat chunk of tokens ``[T, ...]`` split into sequences by
``cu_seqlens`` (int ``[N + 1]``, from 0), sequence ``i`` starting from ``initial_state[i]`` (``[N, HV, K, V]``;
``None``: zeros, a fresh sequence), and returns ``(o [T, HV, V], final_state [N, HV, K, V] float32)``, FLA's
``output_final_state=True``. It is functional: the caller gathers initial states from its slots (zeros for fresh
sequences) and writes the final ones back. The chunk length (FLA's 64) only tiles the work, and running a sequence
in several calls with the state carried gives the same result as one call.

Oracle: transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``
(``models/qwen3_next/modeling_qwen3_next.py``), compared in ``tests/core/test_delta_rule_ops.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

#: FLA's chunk length; the result does not depend on it.
CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """FLA's ``l2norm`` over the last dimension, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, v_heads: int, scale: Optional[float],
             use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 q (scaled) and k, repeated to one per value head: ``[..., HV, K]``."""
    q, k = (l2norm(q), l2norm(k)) if use_qk_l2norm_in_kernel else (q.float(), k.float())
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    rep = v_heads // q.shape[-2]
    return q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)


def fused_recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, state: torch.Tensor,
                                     state_indices: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                                     use_qk_l2norm_in_kernel: bool = False) -> torch.Tensor:
    """One decode token per sequence (see the module docstring). ``q`` / ``k`` ``[batch, H, K]``; ``v``
    ``[batch, HV, V]``; ``g`` / ``beta`` ``[batch, HV]``; ``state`` ``[num_slots, HV, K, V]`` (in place);
    ``state_indices`` int ``[batch]`` (``None``: row i uses slot i). Returns ``[batch, HV, V]`` in ``v``'s dtype."""
    batch = v.shape[0]
    if state_indices is None:
        state_indices = torch.arange(batch, device=v.device)
    rows = (state_indices >= 0).nonzero().squeeze(1)
    slots = state_indices[rows].long()
    qh, kh = prepare_qk(q[rows], k[rows], v.shape[1], scale, use_qk_l2norm_in_kernel)  # [b, HV, K]
    s = state[slots].float() * torch.exp(g[rows].float())[..., None, None]  # [b, HV, K, V]
    delta = (v[rows].float() - torch.einsum("bhk,bhkv->bhv", kh, s)) * beta[rows].float()[..., None]
    s = s + kh[..., None] * delta[:, :, None, :]
    state[slots] = s.to(state.dtype)
    out = torch.zeros_like(v)
    out[rows] = torch.einsum("bhk,bhkv->bhv", qh, s).to(v.dtype)
    return out


def _chunk_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, float32, heads first: ``q`` / ``k`` ``[HV, L, K]`` (q scaled), ``v`` ``[HV, L, V]``, ``g`` /
    ``beta`` ``[HV, L]``, ``state`` ``[HV, K, V]``. The WY form of FLA's chunked kernel (transformers' torch port):
    within a chunk the sequential delta-rule writes become one unit-triangular solve; chunks then run in order."""
    heads, length = v.shape[0], v.shape[1]
    pad = -length % chunk_size
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))  # beta 0: padding writes nothing
    c = (length + pad) // chunk_size
    q, k, v = (t.reshape(heads, c, chunk_size, -1) for t in (q, k, v))
    g, beta = g.reshape(heads, c, chunk_size), beta.reshape(heads, c, chunk_size)
    g_cum = g.cumsum(-1)  # log decay from the chunk's start to each position
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (g_cum[..., :, None] - g_cum[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [h, c, l, s]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower-triangular once the diagonal is set
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_read = torch.linalg.solve_triangular(system, k_beta * g_cum.exp()[..., None], upper=False,
                                           unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * g_cum.exp()[..., None]
    k_dec = k * (g_cum[..., -1:] - g_cum).exp()[..., None]
    out = torch.empty_like(v)
    for i in range(c):
        u = new_v[:, i] - k_read[:, i] @ state  # the chunk's writes, corrected for what the state predicts
        out[:, i] = q_dec[:, i] @ state + attn[:, i] @ u
        state = state * g_cum[:, i, -1].exp()[:, None, None] + k_dec[:, i].transpose(-1, -2) @ u
    return out.reshape(heads, c * chunk_size, -1)[:, :length], state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: Optional[torch.Tensor] = None,
                           cu_seqlens: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                           use_qk_l2norm_in_kernel: bool = False,
                           chunk_size: int = CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk of sequences (see the module docstring). ``q`` / ``k`` ``[T, H, K]``; ``v`` ``[T, HV, V]``;
    ``g`` / ``beta`` ``[T, HV]``; ``initial_state`` ``[N, HV, K, V]`` or ``None`` (zeros); ``cu_seqlens`` int
    ``[N + 1]`` (``None``: one sequence). Returns ``(o [T, HV, V]`` in ``v``'s dtype, ``final_state [N, HV, K, V]``
    float32)."""
    total, v_heads, v_dim = v.shape
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, total])
    bounds = [int(x) for x in cu_seqlens.tolist()]
    qh, kh = prepare_qk(q, k, v_heads, scale, use_qk_l2norm_in_kernel)
    qh, kh, vh = (t.transpose(0, 1) for t in (qh, kh, v.float()))  # heads first
    gh, bh = g.float().t(), beta.float().t()
    out = torch.zeros(v_heads, total, v_dim, dtype=torch.float32, device=v.device)
    finals = torch.zeros(len(bounds) - 1, v_heads, k.shape[-1], v_dim, dtype=torch.float32, device=v.device)
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        init = finals[i] if initial_state is None else initial_state[i].float()
        if end == start:
            finals[i] = init
            continue
        span = slice(start, end)
        out[:, span], finals[i] = _chunk_one(qh[:, span], kh[:, span], vh[:, span], gh[:, span], bh[:, span], init,
                                             chunk_size)
    return out.transpose(0, 1).to(v.dtype), finals
