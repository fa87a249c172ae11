"""Simulated torch-npu kernels: the signatures vllm-ascend calls them with, core's reference semantics
(``pagedllm.backend.ref_ops``), and the documented input constraints enforced (so the plugin cannot pass what the real op
refuses without a test noticing). Nothing here says how the real kernels behave beyond their documentation.

Sources of the signatures and constraints:
- ``_npu_reshape_and_cache``: vllm-project/vllm-ascend vllm_ascend/attention/attention_v1.py (v0.11.0) and
  vllm_ascend/device/device_op.py (Ascend310PDeviceAdaptor.reshape_and_cache);
- ``_npu_paged_attention`` (and ``_npu_paged_attention_get_workspace``): vllm_ascend/attention/attention_v1.py
  (v0.11.0 ``_forward_decode_only``; main@182b75e ``forward_paged_attention``), context lengths as the host int32
  ``seq_lens``;
- ``npu_fused_infer_attention_score``: vllm_ascend/attention/attention_v1.py (main@182b75e
  ``forward_fused_infer_attention``, TND layout with a block table) and the torch_npu API reference
  (query/key/value FLOAT16 or BFLOAT16; sparse_mode 3 = rightDownCausal with the 2048x2048 compressed mask,
  4 = band from pre_tokens/next_tokens).
"""

from __future__ import annotations

from typing import Optional

import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from torch_npu._device import NPUTensor, _wrap, raw
from torch_npu._graph import capturing

_HALF = (torch.float16, torch.bfloat16)
MASK_SIZE = 2048
INT_MAX = 2147483647


def _on_npu(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, NPUTensor):
        raise RuntimeError(f"{name} must be an npu tensor, got one on {t.device} (simulated npu)")
    return t.raw


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(f"{msg} (simulated torch_npu)")


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices) -> None:
    """Scatter ``[T, Hkv, D]`` keys/values into ``[num_blocks, block_size, Hkv, D]`` caches at flat slots."""
    k, v = _on_npu("key", key), _on_npu("value", value)
    kc, vc = _on_npu("key_cache", key_cache), _on_npu("value_cache", value_cache)
    slots = _on_npu("slot_indices", slot_indices)
    _require(slots.dtype == torch.int32, f"slot_indices must be int32, got {slots.dtype}")
    _require(kc.dim() == 4 and kc.shape == vc.shape, f"caches must be [num_blocks, block_size, Hkv, D], got "
                                                      f"{tuple(kc.shape)} and {tuple(vc.shape)}")
    _require(k.shape == v.shape and k.shape[0] == slots.shape[0] and tuple(k.shape[1:]) == tuple(kc.shape[2:]),
             f"key/value {tuple(k.shape)} do not match slots {tuple(slots.shape)} and cache {tuple(kc.shape)}")
    _require(k.dtype == kc.dtype, f"key dtype {k.dtype} != cache dtype {kc.dtype}")
    nb, bs = kc.shape[0], kc.shape[1]
    if capturing():  # no host read inside a graph: the check runs (and raises) at every replay instead
        torch._assert_async(((slots >= 0) & (slots < nb * bs)).all(), "slot indices outside the cache")
    elif slots.numel():
        _require(int(slots.min()) >= 0 and int(slots.max()) < nb * bs,
                 f"slot indices must lie in [0, {nb * bs}); got [{int(slots.min())}, {int(slots.max())}]")
    flat = slots.long()
    kc.view(nb * bs, *kc.shape[2:])[flat] = k
    vc.view(nb * bs, *vc.shape[2:])[flat] = v


def _reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, block_table: torch.Tensor, q_lens: list[int],
               kv_lens: list[int], scale: float, window: Optional[int]) -> torch.Tensor:
    """``ref_ops.paged_attention`` on the canonical stack of the two caches. Lengths are host values (baked into a
    graph at capture, as on the device); the block table is read as a tensor, so a replay sees its new contents."""
    bs = kc.shape[1]
    if not capturing():
        for i, s in enumerate(kv_lens):
            row = block_table[i, :-(-s // bs)]
            _require(row.numel() == 0 or (int(row.min()) >= 0 and int(row.max()) < kc.shape[0]),
                     f"block table row {i} points outside [0, {kc.shape[0]})")
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                             seq_lens=torch.tensor(kv_lens, dtype=torch.int32), block_tables=block_table,
                             slot_mapping=torch.empty(0, dtype=torch.long), max_query_len=max(q_lens),
                             max_seq_len=max(kv_lens), num_decodes=0, block_size=bs, query_start_loc_cpu=qsl,
                             seq_lens_cpu=list(kv_lens))
    return ref_ops.paged_attention(q, torch.stack((kc, vc)), meta, scale, window, None)


def _npu_paged_attention_get_workspace(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                                       block_table, context_lens, out) -> torch.Tensor:
    """The workspace vllm-ascend sizes before capturing ``_npu_paged_attention`` (the simulation needs none)."""
    return _wrap(torch.empty(0, dtype=torch.uint8))


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out, workspace=None) -> None:
    """Decode: one query token per sequence ``[B, N, D]``, written into ``out``."""
    q, o = _on_npu("query", query), _on_npu("out", out)
    kc, vc = _on_npu("key_cache", key_cache), _on_npu("value_cache", value_cache)
    bt = _on_npu("block_table", block_table)
    _require(q.dtype in _HALF and kc.dtype == q.dtype, f"query/cache must be float16 or bfloat16 and match, got "
                                                        f"{q.dtype}/{kc.dtype}")
    _require(not isinstance(context_lens, NPUTensor) and context_lens.dtype == torch.int32,
             "context_lens must be a host int32 tensor (vllm-ascend passes seq_lens_cpu)")
    _require(bt.dtype == torch.int32, f"block_table must be int32, got {bt.dtype}")
    lens = context_lens.tolist()
    _require(q.dim() == 3 and q.shape[0] == len(lens) and q.shape[1] == num_heads and kc.shape[2] == num_kv_heads,
             f"query {tuple(q.shape)}, {len(lens)} context lengths, num_heads={num_heads}, "
             f"num_kv_heads={num_kv_heads}, cache {tuple(kc.shape)}")
    _require(o.shape == q.shape and o.dtype == q.dtype, "out must match query")
    o.copy_(_reference(q, kc, vc, bt, [1] * len(lens), lens, scale_value, None))


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
                                    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0,
                                    pre_tokens=INT_MAX, next_tokens=INT_MAX, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
                                    softmax_lse_flag=False, **others):
    """Only what the plugin uses is simulated: TND layout over a paged cache (``key``/``value`` are
    ``[num_blocks, block_size, Hkv * D]`` views), sparse_mode 3 (causal, right-down aligned) or 4 (band:
    ``q_pos - k_pos <= pre_tokens`` and ``k_pos - q_pos <= next_tokens``, next_tokens 0 only). Returns
    ``(attention_out [T, N, D], softmax_lse)``; the lse is not simulated (an empty tensor)."""
    unsupported = {k: v for k, v in others.items() if v is not None}
    if unsupported or pse_shift is not None:
        raise NotImplementedError(f"simulated FIA: arguments not simulated: {sorted(unsupported)}")
    _require(input_layout == "TND" and block_table is not None, "simulated FIA covers the TND layout with a "
                                                                 "block table only")
    q, kc, vc = _on_npu("query", query), _on_npu("key", key), _on_npu("value", value)
    bt = _on_npu("block_table", block_table)
    _require(q.dtype in _HALF and kc.dtype == q.dtype, f"query/key must be float16 or bfloat16 and match, got "
                                                        f"{q.dtype}/{kc.dtype}")
    _require(bt.dtype == torch.int32, f"block_table must be int32, got {bt.dtype}")
    _require(kc.dim() == 3 and kc.shape[1] == block_size, f"paged key must be [num_blocks, block_size={block_size}, "
                                                          f"H*D], got {tuple(kc.shape)}")
    n_kv = num_key_value_heads or num_heads
    head = q.shape[2]
    _require(q.shape[1] == num_heads and kc.shape[2] == n_kv * head, f"query {tuple(q.shape)} / key "
                                                                       f"{tuple(kc.shape)} vs {num_heads} heads, "
                                                                       f"{n_kv} kv heads")
    ends, kv_lens = [int(x) for x in actual_seq_lengths], [int(x) for x in actual_seq_lengths_kv]
    _require(len(ends) == len(kv_lens) and ends == sorted(ends) and ends and ends[-1] == q.shape[0],
             f"TND actual_seq_lengths must be cumulative query ends ending at T={q.shape[0]}, got {ends}")
    q_lens = [e - s for s, e in zip([0] + ends[:-1], ends)]
    _require(all(0 < ql <= kl for ql, kl in zip(q_lens, kv_lens)), f"q lens {q_lens} vs kv lens {kv_lens}")
    mask = raw(atten_mask) if atten_mask is not None else None
    want = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE), diagonal=1)
    _require(isinstance(atten_mask, NPUTensor) and mask.shape == want.shape
             and (capturing() or torch.equal(mask.float(), want)),
             "sparse_mode 3/4 take the 2048x2048 compressed causal mask (triu(ones, 1)) on the device")
    if sparse_mode == 3:
        window = None
    elif sparse_mode == 4:
        _require(next_tokens == 0, "simulated band mode: next_tokens must be 0")
        window = pre_tokens + 1 if pre_tokens < INT_MAX else None
    else:
        raise NotImplementedError(f"simulated FIA: sparse_mode {sparse_mode} not simulated")
    k4 = kc.view(kc.shape[0], kc.shape[1], n_kv, head)
    v4 = vc.view(vc.shape[0], vc.shape[1], n_kv, head)
    out = _reference(q, k4, v4, bt, q_lens, kv_lens, scale, window)
    return _wrap(out), _wrap(torch.empty(0, dtype=torch.float32))


def npu_rms_norm(x, gamma, epsilon=1e-6):
    """``(y, rstd)``: vllm_ascend/ops/layernorm.py (v0.11.0) calls ``npu_rms_norm(x, weight, eps)``."""
    xr, g = _on_npu("x", x), _on_npu("gamma", gamma)
    rstd = torch.rsqrt(xr.float().pow(2).mean(-1, keepdim=True) + epsilon)
    return _wrap(ref_ops.rms_norm(xr, g, epsilon)), _wrap(rstd)


def npu_swiglu(x, dim=-1):
    """``silu(first half) * second half`` along ``dim``: vllm_ascend/ops/activation.py (v0.11.0)."""
    xr = _on_npu("x", x)
    _require(dim in (-1, xr.dim() - 1), "simulated npu_swiglu: last dimension only")
    return _wrap(ref_ops.silu_and_mul(xr))


def npu_fusion_attention(*args, **kwargs):
    """Present because transformers imports it when torch_npu is importable (integrations/npu_flash_attention.py);
    the plugin never calls it, so it is not simulated."""
    raise NotImplementedError("npu_fusion_attention is not simulated (pagedllm's ascend plugin does not call it)")
