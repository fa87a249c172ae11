"""Ragged paged attention in ``jax.numpy``: tpu-inference's semantics, written to trace with fixed shapes.

Inputs follow tpu-inference's ``ref_ragged_paged_attention`` (vllm-project/tpu-inference
``tpu_inference/kernels/ragged_paged_attention/v3/kernel.py``): a flat ragged batch of query tokens, the KV pages,
``kv_lens`` (context length of each sequence including this step's tokens), ``page_indices`` (each sequence's pages)
and ``cu_q_lens`` (query start offsets, length ``num_seqs + 1``). Token ``j`` of sequence ``i``'s chunk sits at position
``kv_lens[i] - q_len_i + j`` and attends causally (and within ``sliding_window``) to that sequence's keys; scores are
float32, scaled by ``sm_scale``, soft-capped ``c * tanh(s / c)``, masked with a large finite negative (tpu-inference's
``DEFAULT_MASK_VALUE``: ``-inf - -inf`` would be NaN).

tpu-inference's reference loops over sequences with data-dependent slices, which cannot be jitted at a fixed shape.
This version is vectorised over tokens instead: every token gathers its own sequence's pages (``[T, W * page_size]``
keys), so one program per ``(T, S, W)`` bucket serves any mix of decodes and prefill chunks. Padding tokens (rows past
``cu_q_lens[-1]``) and padding sequences (``q_len = kv_len = 0``) are fully masked and produce finite garbage that is
never read. It costs ``O(T x W x page_size)`` memory, so it is the correctness path for JAX's CPU device; on a TPU the
Pallas kernel (``tpu_inference.kernels.ragged_paged_attention.v3.kernel.ragged_paged_attention``, TPU-only, needs
``head_dim`` padded to 128) is the production path — not wired here, because it cannot run or be tested on this
machine.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedllm_tpu.kv_cache import split_kv

#: tpu-inference's DEFAULT_MASK_VALUE: -0.7 * float32 max.
MASK_VALUE = -0.7 * 3.4028234663852886e38


def ragged_paged_attention(queries: Any, kv_pages: Any, kv_lens: Any, page_indices: Any, cu_q_lens: Any, *,
                           sm_scale: float, sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None) -> Any:
    """``queries [T, Hq, D]``, ``kv_pages [N, P, 2 * Hkv, D]``, ``kv_lens [S]``, ``page_indices [S, W]``,
    ``cu_q_lens [S + 1]`` (int32) -> ``[T, Hq, D]`` in the queries' dtype."""
    import jax
    import jax.numpy as jnp

    t, hq, d = queries.shape
    _, page_size, h2, _ = kv_pages.shape
    hkv = h2 // 2
    s, w = page_indices.shape
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_q_lens[1:], tok, side="right"), 0, s - 1).astype(jnp.int32)
    valid = tok < cu_q_lens[-1]
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    q_pos = kv_lens[seq] - q_len + (tok - q_start)  # [T]

    pages = kv_pages[page_indices[seq]]  # [T, W, P, 2Hkv, D]
    k, v = split_kv(pages.reshape(t, w * page_size, h2, d))  # [T, L, Hkv, D]
    q = queries.reshape(t, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("tkgd,tlkd->tkgl", q, k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) * sm_scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    k_pos = jnp.arange(w * page_size, dtype=jnp.int32)[None, :]
    mask = (k_pos <= q_pos[:, None]) & valid[:, None]
    if sliding_window is not None:
        mask &= (q_pos[:, None] - k_pos) < sliding_window
    scores = jnp.where(mask[:, None, None, :], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    # A masked key has probability 0, but 0 x NaN is NaN: unwritten slots (NaN-filled pool) must not reach the sum.
    v = jnp.where(mask[:, :, None, None], v.astype(jnp.float32), 0.0)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, v, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(t, hq, d).astype(queries.dtype)
