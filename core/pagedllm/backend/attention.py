"""The flat-batch description every paged-attention kernel reads (built once per step by the model runner)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol

import torch


class KVLayerHooks(Protocol):
    """A KV connector's per-layer calls for one step (``kv_transfer/runtime.py``), handed to the model in its
    metadata rather than through a global (vLLM's ``get_forward_context()``). The layer is named by its cache."""

    def wait_for_layer_load(self, kv_cache: Any) -> None:
        """Before the layer reads ``kv_cache``: its loads have landed."""

    def save_kv_layer(self, kv_cache: Any, meta: "AttentionMetadata") -> None:
        """After the layer wrote ``kv_cache``: the connector may save it."""


@dataclass
class AttentionMetadata:
    """One step's batch: ``B`` sequences, ``T`` query tokens in total, decodes ordered first.

    Device tensors are what kernels read; the ``*_cpu`` lists mirror them for backends that plan on the host.

    Inside a captured graph (what must live in persistent buffers): the model itself reads only ``slot_mapping``
    (handed to ``write_kv`` / ``write_mla_kv``), ``state_indices`` / ``has_initial_state`` (models with recurrent
    state: decode graphs run them eager, ``StaticGraphRunner`` keeps both in its bucket buffers) and
    ``lora_mapping`` (``None`` whenever graphs run: LoRA steps run eager), besides its ``input_ids`` and
    ``positions``; it hands this object unchanged to ``paged_attention`` /
    ``mla_attention``, so every other field a graph reads is one the backend's attention kernel reads — typically
    ``query_start_loc``, ``seq_lens``, ``block_tables``, which core's graph runners (``StaticGraphRunner``,
    ``DecodeGraphRunner``) keep persistent with ``slot_mapping``. The host fields (``max_query_len``,
    ``max_seq_len``, ``num_decodes``, ``*_cpu``, ``extra``) change every step outside the graph: a captured program
    that reads one keeps the capture's value (a compiler guards on it and recompiles). Core's reference attention
    (``ref_ops``) plans on the ``*_cpu`` lists, so a captured backend brings its own attention.
    """

    query_start_loc: torch.Tensor  # int32 [B+1]: sequence i owns query rows [qsl[i], qsl[i+1])
    seq_lens: torch.Tensor  # int32 [B]: tokens in context *including* this step's new ones
    block_tables: torch.Tensor  # int32 [B, max_blocks]: physical block ids, padded with 0
    slot_mapping: torch.Tensor  # int64 [T]: flat cache slot of each new token, -1 = padding
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # sequences [0, num_decodes) have query_len == 1
    block_size: int
    query_start_loc_cpu: list[int] = field(default_factory=list)
    seq_lens_cpu: list[int] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # backend-private per-step precomputation
    lora_mapping: Any = None  # pagedllm.lora.ops.LoRAMapping when the step runs LoRA adapters, else None
    # Models with recurrent state (contract v3, ``hookspec.MambaSpec``), else None: each sequence's state slot
    # (int32 [B], -1 = padding) and whether its chunk continues the sequence (bool [B]: num_computed_tokens > 0)
    # or starts it fresh (the slot's old contents are never read then).
    state_indices: Optional[torch.Tensor] = None
    has_initial_state: Optional[torch.Tensor] = None
    # PrefixLM image spans (vLLM's ``mm_prefix_range``; Gemma 3 with vision), else None: per sequence, the position
    # ranges ``[start, end)`` (half-open, unlike vLLM's inclusive end) within which attention is bidirectional, as
    # host lists. A query at position q in a span also sees the span's keys after q (the sliding window still bounds
    # how far back it looks); outside spans attention stays causal. Set only for a model whose ``ModelInfo`` says
    # ``mm_prefix_lm`` and only on backends declaring ``Capabilities.mm_prefix_lm``; a span never straddles two
    # chunks (the scheduler keeps it whole: multimodal/prefix_lm.py).
    mm_prefix_ranges: Optional[list[list[tuple[int, int]]]] = None

    # Sliding-window KV groups (``sched/kv_groups.py``), else None: each group's ``(block_tables, slot_mapping)``
    # (a freed block reads as block 0, outside the window). A layer runs on ``for_kv_group(its group)``.
    kv_group_tables: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None

    # An eager step with a KV connector (docs/kv-offload.md), else None: each attention layer calls
    # ``kv_connector.wait_for_layer_load(kv_cache)`` before it reads its cache and ``save_kv_layer(kv_cache, meta)``
    # after it wrote it (vLLM's ``wait_for_kv_layer_from_connector`` / ``maybe_save_kv_layer_to_connector``).
    kv_connector: Optional[KVLayerHooks] = None

    def for_kv_group(self, group: int) -> "AttentionMetadata":
        """This step as one KV group's layers see it: its block table and slots, its own ``extra`` (a backend's
        per-step plans depend on the table); made once per step and group, on first use. Without groups: self."""
        if self.kv_group_tables is None:
            return self
        views = self.__dict__.setdefault("_kv_group_views", {})
        view = views.get(group)
        if view is None:
            bt, slots = self.kv_group_tables[group]
            view = views[group] = replace(self, block_tables=bt, slot_mapping=slots, extra=dict(self.extra),
                                          kv_group_tables=None)
        return view

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_cpu[-1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        slot_mapping: list[int] | None = None,
    ) -> "AttentionMetadata":
        """Build from host lists; ``slot_mapping`` defaults to the slots of each sequence's last query tokens."""
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        if slot_mapping is None:
            slot_mapping = []
            for q, s, bt in zip(query_lens, seq_lens, block_tables):
                for pos in range(s - q, s):
                    slot_mapping.append(bt[pos // block_size] * block_size + pos % block_size)
        width = max((len(b) for b in block_tables), default=0) or 1
        bt = torch.zeros((len(block_tables), width), dtype=torch.int32)
        for i, b in enumerate(block_tables):
            if b:
                bt[i, : len(b)] = torch.tensor(b, dtype=torch.int32)
        num_decodes = 0
        for q in query_lens:
            if q != 1:
                break
            num_decodes += 1
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=bt.to(device),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            num_decodes=num_decodes,
            block_size=block_size,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=list(seq_lens),
        )
