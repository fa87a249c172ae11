"""Flat-block paged attention (vllm-hpu-extension's ``flat_pa``), pure torch, static shapes, no host sync.

Gaudi's matrix engine prefers a few large batched matmuls to a gather-heavy kernel, so vllm-hpu-extension lays the
step's KV blocks out as one flat list and computes attention block by block (vllm_gaudi/extension/ops.py ``flat_pa``,
``pipelined_pa``, ``batch2block``, ``block2batch``, ``grouped_max``; the same code lived in
HabanaAI/vllm-hpu-extension vllm_hpu_extension/ops.py):

- ``block_list`` [N]: the physical block of each flat entry;
- ``block_groups`` [N]: the query row the entry belongs to;
- ``block_mapping`` [N, T]: ``one_hot(block_groups)``, so ``block_mapping @ x`` copies each row's query to its
  blocks (batch2block) and ``block_mapping.T @ y`` sums the blocks back into rows (block2batch);
- ``block_bias`` [N, block_size]: 0 for keys the row may see, -inf for the rest (vllm-gaudi builds it from
  ``block_usage`` in hpu_model_runner.py ``_set_block_mapping``).

Each entry's softmax is computed locally (its max and sum), then rescaled by the row's max over its entries and
normalised by the row's sum — the online-softmax merge, with every step a matmul or an elementwise op.

vllm-gaudi uses ``flat_pa`` for decodes (one row per sequence) and a separate prompt attention for prefills. Here
one row is one *query token*: a decode is a row with its sequence's blocks, a prefill-chunk token is a row whose
bias also hides the keys after its own position, so decodes, chunked prefill and prefix-cached context share one
static-shape program of ``N = num_tokens x block_table_width`` entries. The metadata is derived on the device from
core's ``AttentionMetadata`` with shape-static ops (vllm-gaudi builds the lists on the host because its model
runner owns input preparation; inside a captured HPU graph, host-built values would be frozen at capture).

Differences from the vendor code, both for the contract's "unwritten slots are garbage" rule (vllm-gaudi relies on
zero-filled caches and additive bias): masked scores are *replaced* by -inf and masked values by 0, so a NaN in an
unused slot never reaches an output; entries with no visible key get weight 0 instead of NaN. Scores are float32
(vllm-hpu-extension's ``fp32_softmax``). Sliding window and soft-cap are added to the bias / scores.

Runs on any device (the fake-HPU tests run it on CPU tensors). Not verified on hardware.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.backend.attention import AttentionMetadata

# vllm-hpu-extension's grouped_max uses index_reduce_, which torch flags as beta on every call.
warnings.filterwarnings("ignore", message=r"index_reduce\(\) is in beta")


@dataclass
class FlatMetadata:
    block_list: torch.Tensor  # int64 [N]
    block_groups: torch.Tensor  # int64 [N]
    block_mapping: torch.Tensor  # float32 [N, T]
    block_masked: torch.Tensor  # bool [N, block_size]: True = key hidden from the row
    num_rows: int
    block_pad: torch.Tensor  # bool [N]: entry of a padding row (its key and value read as 0)


def flat_metadata(meta: AttentionMetadata, num_tokens: int, sliding_window: Optional[int] = None) -> FlatMetadata:
    """One row per query token; entry ``(t, j)`` is block ``j`` of token ``t``'s sequence. Padding rows (past
    ``query_start_loc[-1]``) see one key of their block 0, so every row has a finite softmax, and that key and its
    value read as 0 (``block_pad``): block 0 may never have been written, and one NaN there would reach every row
    through the one-hot ``block2batch`` matmul (0 * NaN = NaN)."""
    dev = meta.block_tables.device
    bs = meta.block_size
    num_seqs, width = meta.block_tables.shape
    t = torch.arange(num_tokens, device=dev)
    qsl = meta.query_start_loc.to(torch.int64)
    ends = qsl[1:].contiguous()
    seq = torch.searchsorted(ends, t, right=True)  # the sequence whose query rows hold t
    real = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    pos = meta.seq_lens.to(torch.int64)[seq] - (ends[seq] - t)  # token t's position in its sequence
    pos = torch.where(real, pos, torch.zeros_like(pos))
    block_list = meta.block_tables.to(torch.int64)[seq].reshape(-1)  # [T * W]
    key_pos = (torch.arange(width, device=dev)[:, None] * bs + torch.arange(bs, device=dev)[None, :])  # [W, bs]
    masked = key_pos[None] > pos[:, None, None]  # causal (decode rows: everything after the context)
    if sliding_window is not None:
        masked |= (pos[:, None, None] - key_pos[None]) >= sliding_window
    groups = t.repeat_interleave(width)
    mapping = torch.nn.functional.one_hot(groups, num_classes=num_tokens).to(torch.float32)
    block_pad = (~real).repeat_interleave(width)
    return FlatMetadata(block_list, groups, mapping, masked.reshape(num_tokens * width, bs), num_tokens, block_pad)


def batch2block(x: torch.Tensor, block_mapping: torch.Tensor) -> torch.Tensor:
    """Row values to their entries: ``block_mapping @ x`` (vllm_gaudi/extension/ops.py ``batch2block``)."""
    return torch.matmul(block_mapping, x.reshape(x.shape[0], -1)).view(-1, *x.shape[1:])


def block2batch(x: torch.Tensor, block_mapping: torch.Tensor) -> torch.Tensor:
    """Sum entries into their rows: ``block_mapping.T @ x`` (vllm_gaudi/extension/ops.py ``block2batch``)."""
    return torch.matmul(block_mapping.t(), x.reshape(x.shape[0], -1)).view(-1, *x.shape[1:])


def grouped_max(block_max: torch.Tensor, num_rows: int, block_groups: torch.Tensor) -> torch.Tensor:
    """Each entry's row maximum (vllm_gaudi/extension/ops.py ``grouped_max``: ``index_reduce_`` amax)."""
    out = torch.full((num_rows, *block_max.shape[1:]), float("-inf"), dtype=block_max.dtype, device=block_max.device)
    out.index_reduce_(0, block_groups, block_max, "amax")
    return out.index_select(0, block_groups)


def flat_pa(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, fm: FlatMetadata,
            block_size: int, scale: float, soft_cap: Optional[float] = None) -> torch.Tensor:
    """``query`` [T, H, D]; caches [num_blocks * block_size, Hkv, D] (vllm-gaudi's layout). Returns [T, H, D]."""
    num_tokens, num_heads, head_size = query.shape
    kv_heads = key_cache.shape[1]
    group = num_heads // kv_heads
    n = fm.block_list.shape[0]
    q = batch2block(query.float() * scale, fm.block_mapping).view(n, kv_heads, group, head_size)
    keys = key_cache.view(-1, block_size, kv_heads, head_size).index_select(0, fm.block_list)  # [N, bs, Hkv, D]
    values = value_cache.view(-1, block_size, kv_heads, head_size).index_select(0, fm.block_list)
    scores = torch.matmul(q, keys.float().permute(0, 2, 3, 1))  # [N, Hkv, G, bs]
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    hide = fm.block_masked[:, None, None, :]
    pad = fm.block_pad[:, None, None, None]
    scores = torch.where(hide, float("-inf"), torch.where(pad, 0.0, scores))
    block_max = scores.amax(dim=-1, keepdim=True)  # -inf for an entry with no visible key
    safe_max = torch.where(block_max == float("-inf"), 0.0, block_max)
    attn = torch.exp(scores - safe_max)
    block_sums = attn.sum(dim=-1, keepdim=True)
    values = torch.where(fm.block_masked[:, :, None, None] | pad, 0.0, values.float()).permute(0, 2, 1, 3)  # [N,Hkv,bs,D]
    attn = torch.matmul(attn, values)  # [N, Hkv, G, D]
    # pipelined_pa's merge: rescale each entry by exp(entry max - row max) / row sum.
    block_max = block_max.squeeze(-1)
    adjustment = torch.exp(block_max - grouped_max(block_max, fm.num_rows, fm.block_groups))
    sum_adjusted = block_sums.squeeze(-1) * adjustment
    group_sum = batch2block(block2batch(sum_adjusted, fm.block_mapping), fm.block_mapping)
    group_sum = torch.maximum(group_sum, sum_adjusted)
    attn = attn * (adjustment / group_sum).unsqueeze(-1)
    out = block2batch(attn, fm.block_mapping)  # [T, Hkv, G, D]
    return out.reshape(num_tokens, num_heads, head_size).to(query.dtype)


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, sliding_window: Optional[int],
                    soft_cap: Optional[float]) -> torch.Tensor:
    """The hook's semantics over flat_pa; the metadata is built once per step and window (first layer) and reused
    by the others through ``meta.extra``."""
    key = ("gaudi_flat_pa", query.shape[0], sliding_window)
    fm = meta.extra.get(key)
    if fm is None:
        fm = meta.extra[key] = flat_metadata(meta, query.shape[0], sliding_window)
    return flat_pa(query, key_cache, value_cache, fm, meta.block_size, scale, soft_cap)
