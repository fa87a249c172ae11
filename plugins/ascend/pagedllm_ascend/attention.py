"""KV writes and paged attention through torch-npu's kernels, called as vllm-ascend calls them.

Not verified on hardware: each call below matches the signature vllm-ascend uses (source cited at the call) and
was run only against a simulated torch-npu that implements these ops with core's reference semantics.

Per step, :func:`ascend_metadata` derives once (first layer; the other layers reuse it from ``meta.extra``) the
host-side arguments torch-npu's kernels take as host values — context lengths as a host int32 tensor, cumulative
query ends and per-sequence KV lengths as lists — and the int32 slot mapping; the 2048x2048 compressed causal mask
is built once per device. Dispatch, as vllm-ascend's ``AscendAttentionBackendImpl.forward_impl``:

- decode-only batch, no sliding window: ``torch_npu._npu_paged_attention`` (the decode kernel);
- anything else (prefill, chunked prefill with cached context, mixed, sliding window):
  ``torch_npu.npu_fused_infer_attention_score`` in TND layout over the paged cache (sparse_mode 3, causal aligned
  to the end of each sequence; sparse_mode 4, a band, for sliding windows).

Soft-capping is not offered by either kernel: the plugin does not declare it, so core refuses such models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.graph_runner import HostValuesUnavailable
from pagedllm_ascend import graph
from pagedllm_ascend.vendor import torch_npu

#: The compressed causal mask FIA takes with sparse_mode 3/4: ``triu(ones(2048, 2048), 1)`` as int8 (vllm-ascend
#: vllm_ascend/attention/attention_mask.py ``get_splitfuse_attn_mask``).
MASK_SIZE = 2048
_masks: dict[str, torch.Tensor] = {}


@dataclass
class AscendMetadata:
    """What torch-npu's kernels take beyond core's :class:`AttentionMetadata` (host values are host values)."""

    num_tokens: int
    decode_only: bool
    # int32, host: ``_npu_paged_attention(context_lens=...)`` (vllm-ascend: seq_lens_cpu); None inside a decode
    # graph runner, whose per-step lengths reach the kernel through the per-replay update (graph.py)
    context_lens: Optional[torch.Tensor]
    actual_seq_lengths_q: list[int]  # cumulative query ends (TND), vllm-ascend: query_start_loc_cpu[1:].tolist()
    actual_seq_lengths_kv: list[int]  # per-sequence context lengths, vllm-ascend: seq_lens_list


def ascend_metadata(meta: AttentionMetadata) -> AscendMetadata:
    """Built on the first call of a step and cached in ``meta.extra`` (every layer shares one metadata)."""
    am = meta.extra.get("ascend")
    if am is None:
        qsl = list(meta.query_start_loc_cpu)
        decode_only = meta.num_decodes == len(meta.seq_lens_cpu) > 0
        if isinstance(meta.seq_lens_cpu, HostValuesUnavailable):  # a graph runner's bucket: decodes only
            am = AscendMetadata(num_tokens=qsl[-1], decode_only=decode_only, context_lens=None,
                                actual_seq_lengths_q=qsl[1:], actual_seq_lengths_kv=[])
        else:
            seq_lens = list(meta.seq_lens_cpu)
            am = AscendMetadata(num_tokens=qsl[-1], decode_only=decode_only,
                                context_lens=torch.tensor(seq_lens, dtype=torch.int32),
                                actual_seq_lengths_q=qsl[1:], actual_seq_lengths_kv=seq_lens)
        meta.extra["ascend"] = am
    return am


def causal_mask(device: torch.device) -> torch.Tensor:
    key = str(device)
    mask = _masks.get(key)
    if mask is None:
        mask = _masks[key] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE), diagonal=1).to(torch.int8).to(device)
    return mask


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: tuple, slot_mapping: torch.Tensor) -> None:
    """Store new K/V at flat slots. Slot -1 is core's "skip" (padding); the kernel's handling of negative slots is
    not documented (vllm-ascend never passes one: it slices ``key[:num_actual_tokens]`` and pads graph slots with 0,
    a block vLLM never hands out). So padding rows become copies of the first real row — same slot, same key and
    value, a harmless duplicate write — computed on the device: no host sync, and capturable in a graph."""
    key_cache, value_cache = kv_cache
    n = slot_mapping.shape[0]
    if n == 0:
        return
    valid = slot_mapping >= 0
    first = torch.argmax(valid.to(torch.int32))  # the first real row (argmax returns the first maximum)
    rows = torch.where(valid, torch.arange(n, device=slot_mapping.device), first)
    # vllm-project/vllm-ascend vllm_ascend/attention/attention_v1.py (v0.11.0, reshape_and_cache) and
    # vllm_ascend/device/device_op.py (Ascend310PDeviceAdaptor.reshape_and_cache): int32 slots on the device.
    torch_npu()._npu_reshape_and_cache(key=key[rows].contiguous(), value=value[rows].contiguous(),
                                       key_cache=key_cache, value_cache=value_cache,
                                       slot_indices=slot_mapping[rows].to(torch.int32))


def paged_attention(query: torch.Tensor, kv_cache: tuple, meta: AttentionMetadata, scale: float,
                    sliding_window: Optional[int], soft_cap: Optional[float]) -> torch.Tensor:
    if soft_cap is not None:
        raise NotImplementedError("the Ascend attention kernels have no logit soft-capping (not declared)")
    key_cache, value_cache = kv_cache
    num_blocks, block_size, num_kv_heads, head_size = key_cache.shape
    num_heads = query.shape[1]
    am = ascend_metadata(meta)
    npu: Any = torch_npu()
    query = query.contiguous()
    if am.decode_only and sliding_window is None and query.shape[0] == am.num_tokens:
        out = torch.empty_like(query)
        context_lens = am.context_lens
        if context_lens is None:  # inside the decode graph runner (graph.py)
            if graph.capturing():
                graph.capture_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale,
                                              meta.block_tables, out)
                return out
            # its warm-up runs before capture: any valid lengths do, the output is discarded
            context_lens = torch.ones(query.shape[0], dtype=torch.int32)
        # vllm-project/vllm-ascend vllm_ascend/attention/attention_v1.py: v0.11.0 _forward_decode_only,
        # main@182b75e forward_paged_attention.
        npu._npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache,
                                 num_kv_heads=num_kv_heads, num_heads=num_heads, scale_value=scale,
                                 block_table=meta.block_tables, context_lens=context_lens, out=out)
        return out
    if am.context_lens is None:
        raise RuntimeError("ascend: inside a decode graph only _npu_paged_attention is captured (no sliding window)")
    n = am.num_tokens
    if sliding_window is None:
        band: dict = dict(sparse_mode=3)
    else:
        # vLLM's window W keeps keys with q_pos - k_pos < W; FIA's band keeps q_pos - k_pos <= pre_tokens (torch_npu
        # npu_fusion_attention docs, sparse_mode 4). vllm-ascend passes pre_tokens=W (attention_v1.py, main@182b75e);
        # we pass W - 1 so the band holds exactly W keys, as core's reference does. Not verified on hardware.
        band = dict(sparse_mode=4, pre_tokens=sliding_window - 1, next_tokens=0)
    # vllm-project/vllm-ascend vllm_ascend/attention/attention_v1.py (main@182b75e forward_fused_infer_attention /
    # _get_fia_params): TND query, paged K/V viewed [num_blocks, block_size, Hkv * D], int32 block table,
    # cumulative query ends, per-sequence KV lengths, the compressed causal mask.
    out, _ = npu.npu_fused_infer_attention_score(
        query=query[:n], key=key_cache.view(num_blocks, block_size, -1),
        value=value_cache.view(num_blocks, block_size, -1), atten_mask=causal_mask(query.device),
        block_table=meta.block_tables, input_layout="TND", block_size=block_size,
        actual_seq_lengths=am.actual_seq_lengths_q, actual_seq_lengths_kv=am.actual_seq_lengths_kv,
        num_key_value_heads=num_kv_heads, num_heads=num_heads, scale=scale, **band)
    out = out.view(n, num_heads, head_size)
    if query.shape[0] == n:
        return out
    full = torch.zeros_like(query)  # rows past the real tokens are padding: never read
    full[:n] = out
    return full
