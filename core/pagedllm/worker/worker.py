"""The Worker: everything an engine does on its device (vLLM v1's worker / model-runner split).

``LLMEngine`` keeps requests, scheduling and outputs; the Worker loads the model, sizes the KV pool (a profiling
forward at the largest batch shape where the backend can measure peak memory), allocates device and host caches
through the backend, asks the backend for its batch policy, graph runner and, if it wants one, its own model runner,
warms up every static shape, and runs one step at a time. Everything device-specific goes through backend hooks, so a
vendor never patches this file.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Optional

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.batch_policy import BatchPolicy, BatchShape
from pagedllm.config import DTYPES, EngineConfig
from pagedllm.backend.device_sampler import SamplingTensors
from pagedllm.distributed.parallel_state import get_parallel_state
from pagedllm.backend.hookspec import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheSpec, KVCacheTensor,
                                       MambaSpec, MLAAttentionSpec, ModelInfo, RunnerContext, SlidingWindowSpec)
from pagedllm.sched.kv_groups import KVGroupLayout, choose_kv_layout
from pagedllm.sched.kv_manager import KVCacheManager
from pagedllm.backend.kv_quant import kv_torch_dtype
from pagedllm.backend.registry import SwapUnsupported
from pagedllm.lora.slots import LoRAManager
from pagedllm.worker.model_runner import ModelRunner, PendingStep, StepOutput
from pagedllm.worker.state_swap import allocate_host_state_cache, copy_state_slots, split_swap_space
from pagedllm.models import load_config, load_model, resolve_model_path
from pagedllm.pooling import Pooler, PoolingSpec, classifier_of, resolve_pooling
from pagedllm.sample.sampler import Sampler, SamplerOutput
from pagedllm.errors import ParamError, UnsupportedModelError
from pagedllm.sched.scheduler import ScheduledRequest
from pagedllm.spec_decode.config import MODEL_METHODS
from pagedllm.spec_decode.verify import sample_rows, verified_spans, verify
from pagedllm.structured_output.manager import GrammarBitmask
from pagedllm.distributed.binding import local_device
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import EagleProposer, load_eagle_head
from pagedllm.startup_log import stage

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, backend: Any, model_path: str, hf_config: Any, info: ModelInfo,
                 device: Optional[torch.device] = None):
        """``config`` is resolved (``config.resolve_config``): dtype, block size, max_model_len and the token budget
        are final, and the backend's capabilities were checked against the checkpoint. ``device``: this rank's
        (distributed engines); default: data-parallel replica ``config.data_parallel_rank``'s device."""
        self.config, self.backend, self.info = config, backend, info
        self.device = device if device is not None else local_device(backend, config.data_parallel_rank)
        backend.set_device(self.device)
        torch.manual_seed(config.seed)
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = kv_torch_dtype(config.kv_cache_dtype, self.dtype)  # fp8 KV: pagedllm.backend.kv_quant
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.model = load_model(model_path, backend=backend, dtype=self.dtype, device=self.device, config=hf_config,
                                model_impl=config.model_impl, max_model_len=self.max_model_len,
                                quantization=config.quantization)
        if self.kv_dtype != self.dtype and getattr(self.model, "kv_cache_mla", False):
            raise ParamError("kv_cache_dtype", f"{config.kv_cache_dtype!r}: the MLA latent cache of "
                                               f"{info.architecture} is stored in the model dtype only (use auto)")
        if config.enable_lora and not getattr(self.model, "supports_lora", False):
            raise ParamError("enable_lora", f"LoRA runs on native dense models only, not on {info.architecture} "
                                            f"({type(self.model).__name__})")
        # The pooling runner (docs/pooling.md): its resolved spec and pooler; a generation engine refuses a model
        # without an LM head (an embedding checkpoint) by naming the flag.
        self.requires_kv_cache = bool(getattr(self.model, "requires_kv_cache", True))
        #: The model can sample (an LM head over a paged decoder): a pooling engine then serves generation too
        self.can_generate = (getattr(self.model, "can_generate", getattr(self.model, "has_lm_head", True))
                             and self.requires_kv_cache and hasattr(self.model, "compute_logits"))
        self.pooling: Optional[PoolingSpec] = None
        self.pooler: Optional[Pooler] = None
        if config.runner == "pooling":
            self.pooling = resolve_pooling(config, model_path, info.architecture, hf_config.hidden_size,
                                           getattr(self.model, "num_labels", None),
                                           getattr(self.model, "default_pooling_type", "LAST"))
            self.pooler = Pooler(self.pooling, classifier_of(self.model), self.dtype)
        elif not getattr(self.model, "has_lm_head", True) or not self.requires_kv_cache:
            raise ParamError("runner", f"model {model_path} ({info.architecture}) has no LM head to generate with; "
                                       "start it with runner='pooling' (--runner pooling)")
        self.max_num_seqs, self.max_num_batched_tokens = config.max_num_seqs, config.max_num_batched_tokens
        self.pad_slot = -1
        self.policy: BatchPolicy = backend.batch_policy(self._context(BatchPolicy()))
        self._fit_budget_to_policy()
        # A draft model / EAGLE head is loaded before the pool is sized: its K/V (same block ids) shares the budget.
        self.draft_model: Any = None
        spec = config.speculative_config
        if spec is not None and spec.method in MODEL_METHODS:
            self.draft_model = self._load_draft(spec.model, spec.method)
        # Sliding-window KV groups (sched/kv_groups.py): a block id spans group_size layers; None: every layer
        self.kv_layout: Optional[KVGroupLayout] = (
            choose_kv_layout(self.model, config, backend.capabilities.graph_capture, self.policy.static,
                             self.draft_model is not None, backend.implements("pagedllm_model_runner"))
            if self.requires_kv_cache else None)
        self.num_blocks = self._num_blocks() if self.requires_kv_cache else 0
        par = get_parallel_state()
        if par is not None:  # every rank holds the same block ids: the smallest rank's pool decides
            self.num_blocks = par.world_group.all_reduce_min(self.num_blocks)
        if self.requires_kv_cache:
            stage("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB, %s)", self.num_blocks, self.block_size,
                  self.num_blocks * self.block_size, self.num_blocks * self.bytes_per_block() / 2**30,
                  str(self.kv_dtype).removeprefix("torch."))
        else:
            stage("KV cache: none (%s is encoder-only: each prompt runs whole in one step)", info.architecture)
        # Static backends get one block more than the pool hands out: padding tokens write there.
        self.sink_block: Optional[int] = self.num_blocks if self.policy.static else None
        self.pad_slot = self.sink_block * self.block_size if self.sink_block is not None else -1
        if not self.requires_kv_cache:
            self.sink_block, self.pad_slot = None, -1
        spec = self._kv_spec(self.num_blocks + (self.sink_block is not None)) if self.requires_kv_cache else None
        self.kv_spec: Optional[KVCacheSpec] = spec  # (what the KV connector's host copies are shaped after)
        #: The recurrent-state group (LFM2's conv state...), one slot per schedulable sequence; None: no state
        self.state_spec = self._state_spec()
        #: Every KV cache group (paged and state) handed to the backend's allocator (contract v4)
        self.kv_cache_config: Optional[KVCacheConfig] = None
        self.kv_caches: list = []
        if spec is not None or self.state_spec is not None:
            self.kv_cache_config = self._kv_cache_config(spec.num_blocks if spec is not None else 0)
            self._allocate_kv_cache_groups(self.kv_cache_config)
        if self.state_spec is not None:
            stage("state cache: %d slots of %.1f KiB (%s)", self.state_spec.num_slots,
                  self.state_spec.bytes_per_slot / 1024, info.architecture)
        self.host_caches: Optional[list] = None
        self.draft_host_caches: Optional[list] = None
        draft_spec = self._draft_kv_spec(self.num_blocks)
        if draft_spec is not None:
            self.draft_model.kv_caches = backend.allocate_kv_cache(draft_spec)
        self.num_host_blocks = (int(config.swap_space * (1 << 30) // self.bytes_per_block())
                                if self.requires_kv_cache and self.model.num_layers else 0)
        #: Host slots for swapped-out requests' recurrent state (worker/state_swap.py); None: no state swap
        self.host_state_caches: Optional[list] = None
        self.num_host_state_slots = 0
        if self.state_spec is not None and config.swap_space > 0:  # a swapped request takes its state slot along
            self.num_host_blocks, self.num_host_state_slots = split_swap_space(
                int(config.swap_space * (1 << 30)), self.bytes_per_block(), self.state_spec,
                -(-self.max_model_len // self.block_size))
        if self.kv_layout is not None and self.num_host_blocks:  # (swap moves one block table per request)
            logger.info("%s: preemption recomputes (no swap space for KV groups)", self.kv_layout.describe())
            self.num_host_blocks = 0
        if self.num_host_blocks > 0 and not self.model.num_layers:  # pure Mamba2: host blocks hold nothing either
            self.host_caches = []
        elif self.num_host_blocks > 0:
            pinned = backend.memory_info(self.device).pinned_host
            host_spec = replace(spec, num_blocks=self.num_host_blocks, device=torch.device("cpu"))
            try:
                self.host_caches = backend.allocate_host_kv_cache(host_spec, pinned)
                if draft_spec is not None:  # swapped with the target's blocks (spec_decode keeps the draft's K/V)
                    self.draft_host_caches = backend.allocate_host_kv_cache(
                        replace(draft_spec, num_blocks=self.num_host_blocks, device=torch.device("cpu")), pinned)
            except SwapUnsupported as e:  # no host pool: the scheduler preempts by recompute
                logger.warning("%s", e)
                self.host_caches = self.draft_host_caches = None
                self.num_host_blocks = 0
        if self.host_caches is None:
            self.num_host_state_slots = 0
        if self.num_host_state_slots:
            self.host_state_caches = allocate_host_state_cache(self.state_spec, self.num_host_state_slots)
        self.ctx = self._context(self.policy)
        self.lora: Optional[LoRAManager] = None
        if config.enable_lora:
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras)
        self.draft_proposer: Any = None
        self.sampler = Sampler()
        self.runner: Any = None
        self.graph_level = "none"
        self.graph_stats: dict = {}
        self.warmup_seconds = 0.0

    def _load_draft(self, path: str, method: str) -> Any:
        """The draft model or EAGLE head, in the target's dtype on the same device (its KV cache, of the target's
        block count and ids, is allocated with the pool). Its vocabulary must be the target's."""
        if method == "eagle":
            return load_eagle_head(path, self.model, self.backend, self.dtype, self.device, self.max_model_len)

        try:
            draft_path = resolve_model_path(path)
            draft = load_model(draft_path, backend=self.backend, dtype=self.dtype, device=self.device,
                               config=load_config(draft_path))
        except ParamError:
            raise
        except Exception as e:  # a missing folder / unreadable checkpoint: name the field
            raise ParamError("speculative_config.model", f"cannot load draft model {path!r}: {e}") from e
        if draft.vocab_size != self.model.vocab_size:
            raise ParamError("speculative_config.model", f"draft vocab size {draft.vocab_size} differs from the "
                                                         f"target's {self.model.vocab_size}")
        return draft

    def _draft_kv_spec(self, num_blocks: int) -> Optional[KVCacheSpec]:
        d = self.draft_model
        if d is None:
            return None
        return KVCacheSpec(d.num_layers, num_blocks, self.block_size, d.num_kv_heads, d.head_size, self.kv_dtype,
                           self.device, mla=getattr(d, "kv_cache_mla", False))

    def bytes_per_block(self) -> int:
        """Bytes one block id costs: the target's K/V plus the draft's (which lives at the same block ids)."""
        draft = self._draft_kv_spec(1)
        return self._kv_spec(1).bytes_per_block + (draft.bytes_per_block if draft is not None else 0)

    def _state_bytes(self) -> int:
        """What the state group will cost (one slot per sequence a step may hold); 0 for models without state."""
        m = self.model
        shapes = getattr(m, "state_shapes", None)
        if not shapes:
            return 0
        spec = MambaSpec(m.num_state_layers, self.max_num_seqs, tuple(shapes), tuple(m.state_dtypes), self.device)
        return spec.bytes_per_slot * spec.num_slots

    def _fit_state_slots(self, budget: float) -> None:
        """Recurrent state costs a whole slot per schedulable sequence (e.g. 19 MiB for a mamba2-130m-shaped model):
        at the default ``max_num_seqs`` it may exceed the KV budget. Like vLLM, lower ``max_num_seqs`` until the
        slots take at most half the budget (the rest holds the attention layers' blocks), with one log line."""
        per_slot = self._state_bytes() / self.max_num_seqs
        if not per_slot or self.max_num_seqs * per_slot <= budget / 2:
            return
        fit = max(1, int(max(budget, 0) / 2 // per_slot))
        logger.warning("%s keeps %.1f MiB of recurrent state per sequence: max_num_seqs %d -> %d so that its state "
                       "slots take at most half of the %.2f GiB KV budget (set max_num_seqs or the KV memory to "
                       "choose)", self.info.architecture, per_slot / 2**20, self.max_num_seqs, fit, budget / 2**30)
        self.max_num_seqs = fit

    def _state_spec(self) -> Optional[MambaSpec]:
        """The model's state group (``state_shapes`` / ``state_dtypes`` per layer), with one slot per sequence a step
        may hold; refused where the step cannot hand the model its slots (speculative tokens would have to roll
        state back). Static batch shapes pad the slot indices with -1, which every state op skips."""
        m = self.model
        shapes = getattr(m, "state_shapes", None)
        if not shapes:
            return None
        arch = self.info.architecture
        if self.config.speculative_config is not None:
            raise ParamError("speculative_config", f"{arch} keeps recurrent state per request, which rejected "
                                                   "speculative tokens would have to roll back; serve it without "
                                                   "speculative decoding")
        return MambaSpec(m.num_state_layers, self.max_num_seqs, tuple(shapes), tuple(m.state_dtypes), self.device)

    def _context(self, policy: BatchPolicy) -> RunnerContext:
        return RunnerContext(self.config, self.info, self.max_model_len, self.block_size, self.max_num_seqs,
                             self.max_num_batched_tokens, self.dtype, self.device, policy, self.pad_slot)

    def _kv_spec(self, num_blocks: int) -> KVCacheSpec:
        m = self.model
        layers = self.kv_layout.group_size if getattr(self, "kv_layout", None) is not None else m.num_layers
        return KVCacheSpec(layers, num_blocks, self.block_size, m.num_kv_heads, m.head_size, self.kv_dtype,
                           self.device, mla=getattr(m, "kv_cache_mla", False))

    def _layer_ids(self) -> tuple[list[int], list[int]]:
        """The decoder-layer indices of the paged KV layers and of the state layers, as the model reads its
        ``kv_caches`` / ``state_caches`` (in order; a pipeline stage's layers only)."""
        m = self.model
        layers = getattr(m, "layers", None)
        if getattr(m, "state_shapes", None) and layers is not None:  # hybrid: attention and state layers interleave
            attention = [i for i, layer in enumerate(layers) if getattr(layer, "is_attention", False)]
            state = [i for i, layer in enumerate(layers) if not getattr(layer, "is_attention", False)]
            return attention, state[:m.num_state_layers]
        start = getattr(m, "start_layer", 0)
        return list(range(start, start + m.num_layers)), []

    def _kv_cache_config(self, num_blocks: int) -> KVCacheConfig:
        """The model's KV cache groups for the backend (contract v4): with sliding-window groups
        (``self.kv_layout``) one spec per group and ``group_size`` shared tensors, else one tensor per layer and a
        group per window kind (their blocks all kept); MLA's latent group; the state group."""
        m = self.model
        attention, state = self._layer_ids()
        if len(attention) != m.num_layers:
            raise RuntimeError(f"{type(m).__name__}: {len(attention)} attention layers for {m.num_layers} KV caches")
        page = dict(block_size=self.block_size, num_kv_heads=m.num_kv_heads, head_size=m.head_size,
                    dtype=self.kv_dtype)
        groups: list[KVCacheGroupSpec] = []
        if self.kv_layout is not None:  # local indices are the model's (no pipeline stages with groups)
            for g in self.kv_layout.groups:
                groups.append(KVCacheGroupSpec(g.layers, FullAttentionSpec(**page) if g.sliding_window is None
                                               else SlidingWindowSpec(**page, sliding_window=g.sliding_window)))
            shared = [tuple(g.layers[j] for g in self.kv_layout.groups if j < len(g.layers))
                      for j in range(self.kv_layout.group_size)]
        elif attention and getattr(m, "kv_cache_mla", False):
            groups.append(KVCacheGroupSpec(tuple(attention), MLAAttentionSpec(**page)))
            shared = [(i,) for i in attention]
        else:
            windows = getattr(m, "layer_sliding_windows", None) or []
            kinds: dict[Optional[int], list[int]] = {}
            for i in attention:
                kinds.setdefault(windows[i] if i < len(windows) else None, []).append(i)
            for w in sorted(kinds, key=lambda w: (w is not None, w or 0)):  # full attention first
                groups.append(KVCacheGroupSpec(tuple(kinds[w]), FullAttentionSpec(**page, sliding_window=w)))
            shared = [(i,) for i in attention]
        size = groups[0].kv_cache_spec.page_size_bytes * num_blocks if groups else 0
        if self.state_spec is not None:
            groups.append(KVCacheGroupSpec(tuple(state), self.state_spec))
        return KVCacheConfig(num_blocks, tuple(KVCacheTensor(size, s) for s in shared), tuple(groups), self.device)

    def _allocate_kv_cache_groups(self, config: KVCacheConfig) -> None:
        """Every group's caches through the backend (checked by the registry), handed to the model in its layers'
        order; ``kv_caches`` keeps the distinct paged caches (core's shared tensors first) for swap and the KV
        connectors."""
        caches = self.backend.allocate_kv_cache_groups(config)
        attention, state = self._layer_ids()
        self.model.kv_caches = [caches[i] for i in attention]
        if self.state_spec is not None:
            self.model.state_caches = [caches[i] for i in state]
        distinct = {id(caches[t.shared_by[0]]): caches[t.shared_by[0]] for t in config.kv_cache_tensors}
        distinct.update((id(c), c) for c in self.model.kv_caches)  # a backend's own, unshared layout
        self.kv_caches = list(distinct.values())

    def _layer_caches(self, caches: list) -> list:
        """What each layer reads: its own cache, or with KV groups its tensor among the group size's."""
        return self.kv_layout.layer_caches(caches) if self.kv_layout is not None else caches

    def _fit_budget_to_policy(self) -> None:
        """A static policy bounds every dimension: the scheduler's budget must stay inside the largest shape."""
        lim = self.policy.limits()
        if lim is None:
            return
        per_seq = -(-self.max_model_len // self.block_size)
        if per_seq > lim.num_blocks:
            raise ParamError("max_model_len", f"{self.max_model_len} tokens need {per_seq} blocks of "
                                              f"{self.block_size}; backend {self.backend.name!r}'s largest "
                                              f"block-table bucket is {lim.num_blocks}")
        if self.max_num_batched_tokens > lim.num_tokens or self.max_num_seqs > lim.num_seqs:
            logger.info("batch budget capped by backend %s's buckets: max_num_batched_tokens %d -> %d, "
                        "max_num_seqs %d -> %d", self.backend.name, self.max_num_batched_tokens,
                        min(self.max_num_batched_tokens, lim.num_tokens), self.max_num_seqs,
                        min(self.max_num_seqs, lim.num_seqs))
        self.max_num_batched_tokens = min(self.max_num_batched_tokens, lim.num_tokens)
        self.max_num_seqs = min(self.max_num_seqs, lim.num_seqs)

    # ---- KV sizing -------------------------------------------------------------------------------------------
    def profile_peak_bytes(self) -> Optional[int]:
        """Peak activation memory of one forward at the largest token budget, or None where the backend cannot
        measure it. The forward writes into a one-block scratch cache (every slot is that block's first), so it
        runs before the real pool exists, in any layout."""
        if self.backend.memory_peak(self.device) is None:  # also resets the counter
            return None
        n = self.max_num_batched_tokens
        scratch = self.backend.allocate_kv_cache(self._kv_spec(1))
        self.model.kv_caches = self._layer_caches(scratch)
        meta = dummy_metadata(BatchShape(n, 1, -(-n // self.block_size)), self.block_size, self.device,
                              pad_slot=0, block=0)
        with torch.inference_mode():
            self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                       torch.arange(n, device=self.device) % self.max_model_len, meta)
        self.backend.synchronize(self.device)
        peak = self.backend.memory_peak(self.device)
        self.model.kv_caches = []
        del scratch
        return peak

    def _num_blocks(self) -> int:
        c = self.config
        bpb = self.bytes_per_block()
        per_seq = (-(-self.max_model_len // self.block_size) if self.kv_layout is None else
                   self.kv_layout.blocks_per_seq(self.max_model_len, self.block_size, self.max_num_batched_tokens))
        if c.num_gpu_blocks_override is not None:
            n, field_name = c.num_gpu_blocks_override, "num_gpu_blocks_override"
        else:
            mem = self.backend.memory_info(self.device)
            if c.kv_cache_memory is not None:
                budget, field_name = c.kv_cache_memory, "kv_cache_memory"
            elif mem.default_kv_bytes is not None and c.gpu_memory_utilization is None:
                budget, field_name = mem.default_kv_bytes, "kv_cache_memory"
            else:
                # vLLM's accounting: a fraction of the whole device, less what is in use after load, less the
                # activation peak of the largest step (measured when the backend can).
                util = c.gpu_memory_utilization if c.gpu_memory_utilization is not None else 0.9
                peak = self.profile_peak_bytes()
                used = mem.total_bytes - mem.free_bytes
                budget = util * mem.total_bytes - used - (peak or 0)
                field_name = "gpu_memory_utilization"
                logger.info("KV budget %.2f GiB: %.0f%% of %.2f GiB, %.2f GiB in use after load, %s GiB activation "
                            "peak", budget / 2**30, 100 * util, mem.total_bytes / 2**30, used / 2**30,
                            f"{peak / 2**30:.2f}" if peak is not None else "unmeasured")
            self._fit_state_slots(budget)
            budget -= self._state_bytes()  # a hybrid model's state slots come out of the same budget
            # More blocks than every sequence at full length can use only feed the prefix cache; cap there x2.
            cap = 2 * self.max_num_seqs * per_seq
            # bpb 0: no attention layer (pure Mamba2): the blocks cost nothing, the state slots must fit
            n = min(int(max(budget, 0) // bpb), cap) if bpb else cap * (budget >= 0)
        one_table = -(-self.max_model_len // self.block_size)
        if c.num_gpu_blocks_override is not None and self.kv_layout is not None and one_table <= n < per_seq:
            logger.info("KV groups kept off: %s = %d blocks hold one max_model_len sequence in one block table, "
                        "not in %s (%d)", field_name, n, self.kv_layout.describe(), per_seq)
            self.kv_layout, per_seq = None, one_table
        if n < per_seq:
            raise ParamError(field_name, f"the KV pool would hold {n} blocks ({n * self.block_size} tokens), fewer "
                                         f"than one max_model_len={self.max_model_len} sequence needs ({per_seq}); "
                                         f"give more KV memory or lower max_model_len"
                                         + (f" (recurrent state of {self.max_num_seqs} sequences takes "
                                            f"{self._state_bytes() / 2**30:.2f} GiB of it; lower max_num_seqs)"
                                            if self._state_bytes() else ""))
        return n

    # ---- runners ---------------------------------------------------------------------------------------------
    def start(self, kv: KVCacheManager) -> None:
        """Build the model runner (the backend's own, or core's with the backend's graph runner) and warm up."""
        capture = self.backend.capabilities.graph_capture if not self.config.enforce_eager else "none"
        shapes = len(self.policy.warmup_shapes())
        what = [f"{shapes} batch shapes"] * bool(shapes) + [f"{capture} graph capture"] * (capture != "none")
        if what:
            stage("warming up on %s: %s", self.backend.name, ", ".join(what))
        own = self.backend.model_runner(self.ctx, self.model, kv)
        if self.state_spec is not None:
            if own is not None:
                raise UnsupportedModelError(f"{self.info.architecture} keeps recurrent state per request; backend "
                                            f"{self.backend.name!r} runs its own model runner, which does not hand "
                                            "the model its state slots")
            kv.use_state_slots(self.state_spec.num_slots, self.num_host_state_slots)
        if self.config.speculative_config is not None and (own is not None or self.policy.static):
            raise ParamError("speculative_config", f"backend {self.backend.name!r} runs "
                                                   f"{'its own model runner' if own is not None else 'static batch shapes'}"
                                                   ", which does not verify speculative tokens; use a dynamic backend")
        if self.draft_model is not None:
            eagle = self.config.speculative_config.method == "eagle"
            self.draft_proposer = (EagleProposer if eagle else DraftModelProposer)(self.draft_model, kv, self.device)
        if self.lora is not None and (own is not None or self.policy.static):
            raise ParamError("enable_lora", f"backend {self.backend.name!r} runs "
                                            f"{'its own model runner' if own is not None else 'static batch shapes'}"
                                            ", which does not apply LoRA adapters; serve LoRA on a dynamic backend")
        if own is not None and self.pooler is not None:
            raise ParamError("runner", f"backend {self.backend.name!r} runs its own model runner, which does not "
                                       "pool hidden states; run the pooling runner on a backend without one")
        if own is not None:  # the backend owns the step, warm-up included
            self.runner, self.graph_level = own, getattr(own, "level", "custom")
            return
        eager = self.config.enforce_eager
        if self.state_spec is not None and capture != "none" and not eager and not self.policy.static:
            logger.info("%s keeps recurrent state: running eager (graph runners keep no state slots)",
                        self.info.architecture)
            eager = True
        graph = self.backend.graph_runner(self.model, self.max_num_seqs, self.device, self.ctx) if not eager else None
        if graph is not None and self.state_spec is not None and not graph.stats.get("carries_state"):
            # a static backend's own graph runner: only core's StaticGraphRunner keeps the slots in its buffers
            logger.info("%s keeps recurrent state: running eager (backend %s's graph runner keeps no state slots)",
                        self.info.architecture, self.backend.name)
            graph = None
        if graph is not None:
            self.graph_level, self.graph_stats = graph.level, graph.stats
        self.runner = ModelRunner(self.model, graph.run if graph is not None else self.model, kv, self.device,
                                  self.policy, self.pad_slot, sample=graph.sample if graph is not None else None,
                                  lora=self.lora)
        self.runner.pooler = self.pooler
        self.runner.keep_hidden = hasattr(self.draft_proposer, "record")  # EAGLE drafts from the target's features
        self.warmup()

    def warmup(self) -> None:
        """One forward per static shape — and one forward + sampling where the backend samples on the device — so
        compilation/capture happens now and never while serving."""
        shapes = self.policy.warmup_shapes()
        if not shapes:
            return
        t0 = time.perf_counter()
        runner = self.runner
        block = self.sink_block if self.sink_block is not None else 0
        with torch.inference_mode():
            for shape in shapes:
                meta = dummy_metadata(shape, self.block_size, self.device, self.pad_slot, block)
                # Separate storages, as in a real step: a compiled graph guards on input aliasing, and one warmed up
                # on aliased ids/positions would recompile every bucket at the first real step.
                ids = torch.zeros(shape.num_tokens, dtype=torch.long, device=self.device)
                positions = torch.zeros(shape.num_tokens, dtype=torch.long, device=self.device)
                runner.run(ids, positions, meta)
                if runner.sample is not None and self.pooling is None:  # pooling never samples (nor has logits)
                    rows = torch.zeros(shape.num_seqs, dtype=torch.long, device=self.device)
                    runner.sample(ids, positions, meta, rows, SamplingTensors.build([], shape.num_seqs, self.device))
        self.backend.synchronize(self.device)
        self.warmup_seconds = time.perf_counter() - t0
        logger.info("warmed up %d batch shapes in %.2fs", len(shapes), self.warmup_seconds)

    # ---- the step --------------------------------------------------------------------------------------------
    def execute_model(self, scheduled: list[ScheduledRequest], grammar: Optional[GrammarBitmask] = None,
                      ) -> tuple[StepOutput, Optional[SamplerOutput]]:
        """Run one scheduled step; returns the runner's output and the sampled tokens of the rows that sample
        (``grammar``: the step's token masks, applied before sampling)."""
        return self.finish_model(self.submit_model(scheduled), grammar)

    def submit_model(self, scheduled: list[ScheduledRequest]) -> PendingStep:
        """Start one step (a pipeline-parallel runner returns before the last stage is done: the engine's batch
        queue); ``finish_model`` completes it."""
        submit = getattr(self.runner, "submit", None)
        if submit is None:  # a backend's own model runner: one step at a time
            return PendingStep(self.runner.execute(scheduled))
        return submit(scheduled)

    def finish_model(self, pending: PendingStep, grammar: Optional[GrammarBitmask] = None,
                     ) -> tuple[StepOutput, Optional[SamplerOutput]]:
        """Wait for a submitted step's logits, mask the constrained rows with the step's ``grammar`` bitmask (the
        engine's, made when it scheduled the step) and sample them."""
        step = pending.result()
        sampled = None
        if step.sampled is not None:
            sampled = step.sampled
        elif step.requests:
            rows, mask = grammar.rows_in(step.requests) if grammar is not None else ([], None)
            if rows:  # (grammar requests never speculate: their row is the first of one)
                self._apply_bitmask(step.logits, sample_rows(step.num_logits, rows), mask)
            if step.num_logits is not None:
                sampled = verify(self.sampler, step.logits, step.requests, step.num_logits, step.spec_token_ids)
            else:
                sampled = self.sampler(step.logits, step.requests)
        if step.hidden is not None:
            self.draft_proposer.record(step.hidden, verified_spans(step, sampled))
        return step, sampled

    @torch.inference_mode()  # the logits are an inference tensor
    def _apply_bitmask(self, logits: torch.Tensor, rows: list[int], mask: torch.Tensor) -> None:
        """Mask the constrained rows in place (only those rows pay for it)."""
        mask = mask.to(logits.device)
        if len(rows) == logits.shape[0]:
            self.backend.apply_token_bitmask(logits, mask)
            return
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = logits.index_select(0, idx)
        self.backend.apply_token_bitmask(sub, mask)
        logits.index_copy_(0, idx, sub)

    def swap(self, src_to_dst: list[tuple[int, int]], out: bool, state: list[tuple[int, int]] = ()) -> None:
        """Copy blocks device -> host (``out``) or host -> device, through the backend (its layout, its copy), and
        the swapped requests' recurrent-state slots (``state``: (source slot, destination slot) pairs)."""
        if state:
            caches = (self.model.state_caches, self.host_state_caches)
            copy_state_slots(*(caches if out else caches[::-1]), list(state))
        src, dst = zip(*src_to_dst)
        caches = (self.kv_caches, self.host_caches) if out else (self.host_caches, self.kv_caches)
        self.backend.swap_kv_blocks(caches[0], caches[1], torch.tensor(src), torch.tensor(dst))
        if self.draft_host_caches is not None:
            d = (self.draft_model.kv_caches, self.draft_host_caches)
            self.backend.swap_kv_blocks(*(d if out else d[::-1]), torch.tensor(src), torch.tensor(dst))


def dummy_metadata(shape: BatchShape, block_size: int, device: torch.device, pad_slot: int,
                   block: int) -> AttentionMetadata:
    """Metadata of exactly ``shape`` with every token written to ``pad_slot`` and every block-table entry ``block``:
    warm-up and profiling touch no block a request owns. Tokens are spread evenly over the sequences, each holding at
    most what its ``w`` blocks do; tokens past that are padding rows (after ``query_start_loc[-1]``), as in a real
    step padded to this shape."""
    t, s, w = shape
    real = min(t, s * w * block_size)
    lens = [real // s + (i < real % s) for i in range(s)]
    return AttentionMetadata.build(lens, lens, [[block] * w for _ in range(s)], block_size, device=device,
                                   slot_mapping=[pad_slot] * t)
