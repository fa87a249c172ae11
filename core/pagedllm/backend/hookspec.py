"""The backend contract: every hook a pagedllm backend may implement, in one file.

A backend is a pluggy plugin (a module or object with ``@hookimpl`` functions) published under the
``pagedllm.backends`` entry-point group. Core builds one :class:`pluggy.PluginManager` per backend holding that
backend and core's reference plugin (``pagedllm.backend.reference``, registered ``trylast``), so every optional hook
falls back to core's pure-torch reference ops. Hooks are resolved once, when the backend is selected; the hot path
calls plain functions, not pluggy.

Contract version: :data:`API_VERSION`. Core N loads plugins built for N or N-1 (``BackendInfo.api_version``) and
refuses others with a message naming both versions. Hooks are never changed in place: a spec may gain an argument
(pluggy passes an implementation only the arguments it names, so older implementations keep working), but a changed
meaning is a new hook name and a new API version. A hook core stopped calling is *retired*: its spec moves to
:class:`RetiredSpec`, where it is never bound nor called but still lets a plugin that implements it load (pluggy
refuses an implementation without a spec), with a ``DeprecationWarning``. A retired spec is deleted once core no
longer loads any contract version whose plugins may implement it.

No fall-through: core resolves every hook once to exactly one implementation — the backend's own when it has one,
else core's reference — and calls that alone. A backend's in-place hook (``write_kv``, ``swap_kv_blocks``...) may
return ``None``; the reference never runs after it on the backend's layout.

Version 2 added the hooks a static-shape or graph-first device needs to shape the engine around itself without
patching core: ``pagedllm_update_config`` (block size, dtype, budgets, eager mode, or a refusal, before any weight is
read), ``pagedllm_batch_policy`` (padded, bucketed batch shapes used by the scheduler's budget and the model runner,
with warm-up of every shape), ``pagedllm_memory_peak`` (a profiling forward sizes the KV pool from measured peak
memory), ``pagedllm_allocate_host_kv_cache`` (host swap caches in the backend's layout), ``pagedllm_model_runner``
(a backend may own the whole step), and a :class:`RunnerContext` for ``pagedllm_graph_runner``.

KV-cache layout is the backend's choice. The *canonical* layout, used by the reference ops and by the conformance
suite, is one tensor per layer of shape ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 = keys,
1 = values). A backend with another layout implements every hook that touches a cache — ``pagedllm_write_kv``,
``pagedllm_paged_attention``, ``pagedllm_allocate_host_kv_cache``, ``pagedllm_swap_kv_blocks`` (core swaps blocks to
and from host memory) and ``pagedllm_gather_kv_blocks`` (conformance reads the layout back): core's reference ops
index the canonical layout, and conformance fails a run that leaves one of them to core.

MLA models (DeepSeek-V2/V3) cache one compressed latent row per token instead of per-head keys and values:
``KVCacheSpec.mla`` is set, ``num_kv_heads`` is 1 and ``head_size`` is the latent width (``kv_lora_rank +
qk_rope_head_dim``); the canonical layout is ``[1, num_blocks, block_size, 1, head_size]`` (so the block swap and
gather hooks work unchanged on it), written by ``pagedllm_write_mla_kv`` and read by ``pagedllm_mla_attention``.

Version 3 added recurrent state beside paged K/V (issue 28: LFM2's short convolutions; Mamba2 / gated-delta-rule
layers use the same group): a :class:`MambaSpec` (vLLM's name) describes the state group — per layer, a few state
tensors of fixed shapes and dtypes, one *slot* per running request, the slot index handed to the model in
``AttentionMetadata.state_indices`` — allocated by ``pagedllm_allocate_state_cache``, and the kernel hooks
``pagedllm_causal_conv1d_fn`` (a prefill chunk with initial state, writing the final state) and
``pagedllm_causal_conv1d_update`` (one token). A v2 plugin implements none of them: core's reference
(``pagedllm.backend.conv_ops``) serves them on its own allocator's layout, so v2 plugins load and run these models.
``ModelInfo.state`` names each state layer kind's op families and dtypes; a backend that states
``Capabilities.state_ops`` / ``state_dtypes`` (unset: the reference's coverage, everything) is refused, at start-up,
the models needing more.

Version 4 hands the backend the model's KV cache *groups* (issue 28; vLLM's ``kv_cache_interface``): a
:class:`KVCacheConfig` lists each group's layers (decoder-layer indices) with one spec per group —
:class:`FullAttentionSpec`, :class:`SlidingWindowSpec` (``sliding_window``), :class:`MLAAttentionSpec` (the latent
row) or the recurrent-state :class:`MambaSpec` — and the shared-tensor layout core chose
(:class:`KVCacheTensor`: sliding-window groups share one tensor per group position, so a block id spans one layer of
each group). ``pagedllm_allocate_kv_cache_groups`` returns a cache per layer and may lay each group out its own way
(a distinct tensor per layer where core shares one, a window-sized ring, a state layout of its own) as long as its
kernels index them with the same block ids and slots. A v3 plugin implements no such hook: core builds the groups'
caches from its ``pagedllm_allocate_kv_cache`` and ``pagedllm_allocate_state_cache`` exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from pagedllm.backend.attention import AttentionMetadata
    from pagedllm.backend.batch_policy import BatchPolicy
    from pagedllm.config import EngineConfig

PROJECT = "pagedllm"
API_VERSION = 4
ENTRY_POINT_GROUP = "pagedllm.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendInfo:
    """Identity. ``device_type`` is the torch device type (``cpu``, a GPU's, or a vendor's own)."""

    name: str
    device_type: str
    priority: int = 0  # `--device auto` picks the usable backend with the highest priority
    api_version: int = API_VERSION
    extra: str = ""  # the pip extra that installs it, e.g. "mydevice" for `pip install pagedllm[mydevice]`
    description: str = ""


@dataclass(frozen=True)
class ProbeResult:
    """Whether the backend can run here, and if not, why (driver missing, no device, SDK mismatch...)."""

    usable: bool
    reason: str = ""
    device_name: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What the backend's kernels support; core checks a model/config against this before running.

    Every optional feature (``sliding_window``, ``soft_cap``, ``mla``, ``alibi``, ``attention_sinks``,
    ``on_device_sampling``, ``quantization``, fp8 ``kv_cache_dtypes``) is off unless stated, so a backend that forgets
    one refuses those models instead of running them wrong."""

    dtypes: tuple[str, ...] = ("float32",)  # the first is the default when neither user nor checkpoint decides
    # vLLM ``kv_cache_dtype`` names the kernels store and read: ``auto`` (the model dtype), ``fp8_e4m3`` (also
    # accepted as ``fp8``), ``fp8_e5m2``; semantics in ``pagedllm.backend.kv_quant``. Others are refused before load.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    head_sizes: Optional[tuple[int, ...]] = (64, 128)  # None: any head size
    block_sizes: tuple[int, ...] = (16,)  # the first is the default block size
    # none: eager only; decode: decode-only graphs (like vLLM's UNIFORM_SINGLE_TOKEN_DECODE); full: any batch
    graph_capture: str = "none"
    # Optional features default to off: a backend claims only what it states. Core refuses, by name, a model that
    # needs one the backend does not declare, and conformance tests exactly the declared ones.
    # Sliding-window attention (``sliding_window`` of ``pagedllm_paged_attention``: Mistral, Gemma 2, Qwen2...).
    sliding_window: bool = False
    # Attention logit soft-capping (``soft_cap`` of ``pagedllm_paged_attention``: Gemma 2).
    soft_cap: bool = False
    # MLA models (DeepSeek-V2/V3): the allocator honours ``KVCacheSpec.mla`` and the MLA hooks run on its caches
    # (core's reference MLA hooks do, on the canonical layout).
    mla: bool = False
    # ALiBi position bias (``alibi_slopes`` of ``pagedllm_paged_attention``); ALiBi models are refused without it.
    alibi: bool = False
    # Attention sinks (``sinks`` of ``pagedllm_paged_attention``: GPT-OSS); models with sinks are refused without it.
    attention_sinks: bool = False
    # Bidirectional image spans in prefill attention (``AttentionMetadata.mm_prefix_ranges``: Gemma 3 with vision);
    # models that need them are refused without it.
    mm_prefix_lm: bool = False
    # vLLM quantization method names this backend runs (``gguf``...); weight types without a kernel from
    # ``pagedllm_quantized_linear`` run core's reference (dequantized at load). Others are refused.
    quantization: tuple[str, ...] = ()
    # The graph runner samples inside its captured region (compiled-graph devices): core hands it the sampling
    # parameters of rows that need no host-side work (``SamplingTensors``) and gets token ids back.
    on_device_sampling: bool = False
    # Recurrent state (v3; hybrid / SSM models, ``ModelInfo.state``): the state-op families the backend runs —
    # ``conv`` (causal conv1d: LFM2's short convolutions, the Mamba2 and Gated DeltaNet input convolutions), ``ssm``
    # (Mamba2's selective scan / state update), ``delta_rule`` (Gated DeltaNet) — and the dtype names its state caches
    # hold. ``None`` (not stated, as every v2 plugin): core's reference ops serve whatever the backend leaves to them,
    # so every family in any dtype. A model needing a family or state dtype outside a stated tuple is refused at
    # start-up naming its layer type and the backend; ``state_ops=()`` refuses every model with state.
    state_ops: Optional[tuple[str, ...]] = None
    state_dtypes: Optional[tuple[str, ...]] = None


@dataclass(frozen=True)
class MemoryInfo:
    """Device memory in bytes, so core can size the KV pool from a budget."""

    total_bytes: int
    free_bytes: int
    pinned_host: bool = False  # page-locked host memory available for swap
    # Suggested KV budget when the user sets neither kv_cache_memory nor a utilization fraction. Host backends
    # share RAM with everything else and set one (like vLLM CPU's 4 GiB default); devices leave it None.
    default_kv_bytes: Optional[int] = None


@dataclass(frozen=True)
class KVCacheSpec:
    """What core asks the allocator for: ``num_layers`` caches, each holding ``num_blocks`` blocks of ``block_size``
    tokens x ``num_kv_heads`` x ``head_size`` keys and values (one latent row per token when ``mla``), in ``dtype``
    on ``device``. ``bytes_per_block`` is what one block costs over all layers (core sizes the pool with it)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    # MLA (DeepSeek): one latent row of head_size per token, no separate values (see the module docstring).
    mla: bool = False

    @property
    def bytes_per_block(self) -> int:
        import torch  # heavy: torch

        elem = torch.empty((), dtype=self.dtype).element_size()
        return (1 if self.mla else 2) * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * elem


@dataclass(frozen=True)
class MambaSpec:
    """The recurrent-state group of a hybrid model (vLLM's ``MambaSpec``), beside the paged :class:`KVCacheSpec`:
    ``num_layers`` layers, each holding one tensor per entry of ``shapes`` / ``dtypes``, with ``num_slots`` slots
    (one per running request; ``AttentionMetadata.state_indices`` names each sequence's) on ``device``.

    LFM2's short convolution: one tensor per layer, ``(hidden_size, conv_kernel - 1)`` (the last ``kernel - 1``
    inputs, vLLM's conv-state shape). The per-layer tensors keep the logical shape ``[num_slots, *shapes[i]]``;
    strides and memory placement are the backend's (vLLM stores the conv state transposed and views it)."""

    num_layers: int
    num_slots: int
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]  # torch.dtype per entry of ``shapes``
    device: Any  # torch.device

    @property
    def bytes_per_slot(self) -> int:
        """What one slot costs over all layers."""
        import math

        import torch  # heavy: torch

        return self.num_layers * sum(math.prod(s) * torch.empty((), dtype=d).element_size()
                                     for s, d in zip(self.shapes, self.dtypes))


@dataclass(frozen=True)
class AttentionSpec:
    """v4. One paged attention layer's page (vLLM's ``AttentionSpec``): ``block_size`` tokens x ``num_kv_heads`` x
    ``head_size`` keys and values in ``dtype`` (the KV cache dtype: fp8 when ``kv_cache_dtype`` says so). The
    canonical cache of one layer is ``[2, num_blocks, block_size, num_kv_heads, head_size]``."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any  # torch.dtype

    #: 2: keys and values; 1: one latent row (MLA)
    num_planes = 2

    @property
    def page_size_bytes(self) -> int:
        """What one block of one layer costs."""
        import torch  # heavy: torch

        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_planes * self.block_size * self.num_kv_heads * self.head_size * elem

    def canonical_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The reference ops' layout of one layer's cache of ``num_blocks`` blocks."""
        return (self.num_planes, num_blocks, self.block_size, self.num_kv_heads, self.head_size)


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """v4. Layers whose blocks are all kept. ``sliding_window`` set (vLLM's field of the same name): the layers'
    kernels still apply that window, but core keeps every block (the one-table path: graph capture, static shapes,
    ``disable_hybrid_kv_cache_manager``...)."""

    sliding_window: Optional[int] = None


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """v4. Layers attending the last ``sliding_window`` keys, whose group has its own block table: blocks that left
    the window go back to the pool and the table holds the null block (id 0) in their place, never read."""

    sliding_window: int


@dataclass(frozen=True)
class MLAAttentionSpec(AttentionSpec):
    """v4. MLA (DeepSeek): one latent row of ``head_size`` per token, ``num_kv_heads`` 1; canonical cache
    ``[1, num_blocks, block_size, 1, head_size]`` (see the module docstring)."""

    num_planes = 1


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """v4. One group (vLLM's name): the decoder-layer indices ``layer_ids`` (in the model's order) sharing one block
    table (or, for a :class:`MambaSpec`, the state slots), and their spec."""

    layer_ids: tuple[int, ...]
    kv_cache_spec: Any  # AttentionSpec subclass or MambaSpec

    @property
    def kind(self) -> str:
        """``full``, ``sliding_window``, ``mla`` or ``state``, for messages and dispatch."""
        spec = self.kv_cache_spec
        return {FullAttentionSpec: "full", SlidingWindowSpec: "sliding_window", MLAAttentionSpec: "mla",
                MambaSpec: "state"}.get(type(spec), type(spec).__name__)


@dataclass(frozen=True)
class KVCacheTensor:
    """v4. One paged KV tensor of core's layout (vLLM's name): ``size`` bytes, viewed by every layer of
    ``shared_by`` (one layer per sliding-window group: a block id belongs to one group at a time). A backend may
    ignore the sharing and give each layer its own memory; the block ids stay core's."""

    size: int
    shared_by: tuple[int, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """v4. What ``pagedllm_allocate_kv_cache_groups`` allocates (vLLM's ``KVCacheConfig``): ``num_blocks`` blocks per
    paged layer (the pool, plus a static backend's padding block), ``kv_cache_tensors`` (core's shared layout of the
    paged groups), ``kv_cache_groups`` (paged groups first, then the state group, whose :class:`MambaSpec` holds its
    slot count), on ``device``. Every decoder layer with a cache is in exactly one group."""

    num_blocks: int
    kv_cache_tensors: tuple[KVCacheTensor, ...]
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    device: Any  # torch.device

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Every layer with a cache, in group order."""
        return tuple(i for g in self.kv_cache_groups for i in g.layer_ids)

    def group_of(self, layer_id: int) -> KVCacheGroupSpec:
        return next(g for g in self.kv_cache_groups if layer_id in g.layer_ids)


#: The state-op families of ``Capabilities.state_ops``
STATE_OPS = ("conv", "ssm", "delta_rule")


@dataclass(frozen=True)
class StateLayerInfo:
    """One kind of recurrent-state layer of a model (``ModelInfo.state``): its ``layer_type`` (the config's name:
    ``conv`` for LFM2, ``mamba`` for Mamba2 / Granite-4.0-H, ``linear_attention`` for Gated DeltaNet), the state-op
    families it runs (:data:`STATE_OPS`) and the dtype name of each of its state tensors (``auto``: the engine's
    dtype, e.g. a conv state kept in the model dtype; ``float32``: fixed, e.g. the delta-rule state)."""

    layer_type: str
    ops: tuple[str, ...]
    dtypes: tuple[str, ...]


@dataclass(frozen=True)
class ModelInfo:
    """What core reads from the checkpoint's config before loading any weight (for ``pagedllm_update_config``)."""

    architecture: str
    dtype: str  # the checkpoint's dtype name (``float32``, ``bfloat16``, ``float16``)
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    max_model_len: int  # the model's max_position_embeddings
    sliding_window: Optional[int] = None  # set when any layer slides
    soft_cap: Optional[float] = None
    alibi: bool = False  # ALiBi position bias instead of rotary (Falcon-RW, Baichuan-13B)
    attention_sinks: bool = False  # a learned per-head sink logit in every softmax (GPT-OSS)
    mm_prefix_lm: bool = False  # image tokens attend bidirectionally within their image (Gemma 3 with vision)
    quantization: Optional[str] = None  # e.g. "gguf"
    mla: bool = False  # the cache holds one latent row per token (num_kv_heads 1, head_size = latent width)
    state: tuple[StateLayerInfo, ...] = ()  # recurrent-state layer kinds (hybrid / SSM models); () for none


@dataclass(frozen=True)
class RunnerContext:
    """Everything a graph runner or a backend's own model runner needs to know about the engine it serves.

    ``config`` and ``model_info``: the resolved engine config and the checkpoint's shape; ``max_model_len`` and
    ``block_size``: the engine's context limit and KV block size (block tables are at most ``ceil(max_model_len /
    block_size)`` wide); ``max_num_seqs`` / ``max_num_batched_tokens``: the most sequences and tokens one step
    holds (size persistent buffers from these, never from the model's own maximum); ``dtype`` / ``device``: the
    model's; ``policy``: the batch policy every step is padded to; ``pad_slot``: where padding tokens write."""

    config: "EngineConfig"  # resolved: block_size, dtype and budgets are final
    model_info: ModelInfo
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    dtype: Any  # torch.dtype
    device: Any  # torch.device
    policy: "BatchPolicy"
    # A slot padding tokens may write to: inside a block the pool never hands out (static backends), else -1.
    pad_slot: int = -1


@dataclass(frozen=True)
class QuantizedWeight:
    """A linear layer's weight kept in its checkpoint's quantized layout, built by core for a backend's kernel.

    ``method`` is the vLLM quantization name (``gguf``); ``weight_type`` the scheme inside it (GGUF: ``Q4_1``...);
    ``data`` the packed tensor (GGUF: the raw blocks, uint8 ``[out_features, bytes_per_row]``); ``shape`` is the
    dense ``(out_features, in_features)``; ``tensors`` the layout's other tensors by checkpoint leaf name (fp8:
    ``weight_scale``). ``pagedllm.backend.dequantize`` is its exact meaning."""

    method: str
    weight_type: str
    data: Any  # torch.Tensor
    shape: tuple[int, int]
    tensors: dict = field(default_factory=dict)


@dataclass(frozen=True)
class QuantizedLinearKernel:
    """Returned by ``pagedllm_quantized_linear``: ``prepare(weight, dtype, device)`` runs once at load (repack into
    the kernel's layout) and returns an opaque state; ``apply(state, x, bias)`` computes ``x @ W.T + bias`` for
    activations ``[T, in_features]`` in the model's ``dtype``, returning that dtype."""

    prepare: Callable[[QuantizedWeight, Any, Any], Any]
    apply: Callable[[Any, "torch.Tensor", Optional["torch.Tensor"]], "torch.Tensor"]
    name: str = ""


@dataclass
class GraphRunner:
    """Returned by ``pagedllm_graph_runner``: ``run(input_ids, positions, meta) -> hidden_states``.

    ``level`` says what it captured (``none``, ``decode``, ``full``, ``compile``); ``stats`` is free-form.
    """

    run: Callable[..., "torch.Tensor"]
    level: str = "none"
    stats: dict = field(default_factory=dict)
    # With ``Capabilities.on_device_sampling``: ``sample(input_ids, positions, meta, logits_indices, tensors) ->
    # token ids [len(logits_indices)]``, forward + logits + sampling in one region. None: core samples on the host.
    sample: Optional[Callable[..., "torch.Tensor"]] = None


class BackendSpec:
    """Hook specifications. Required hooks are marked REQUIRED; the rest fall back to reference ops."""

    # ---- identity and discovery (REQUIRED) -------------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_backend_info(self) -> BackendInfo:
        """REQUIRED. Name, torch device type, auto-selection priority, contract version, install extra."""

    @hookspec(firstresult=True)
    def pagedllm_probe(self) -> ProbeResult:
        """REQUIRED. Is the backend usable on this machine? Never raises: return ``usable=False`` with the reason."""

    @hookspec(firstresult=True)
    def pagedllm_capabilities(self) -> Capabilities:
        """Dtypes, KV dtypes, head/block sizes, graph-capture level, optional features (sliding window, soft cap, MLA,
        ALiBi, on-device sampling), quantization methods; every optional feature is off unless stated. Default
        (no implementation): ``Capabilities()`` plus the features of core's reference ops the backend leaves to
        them — sliding window and soft cap when it has no ``pagedllm_paged_attention`` of its own, MLA when it has
        neither MLA hooks nor an allocator of its own. ALiBi is added whenever the reference attention runs
        (``registry.Backend.capabilities``)."""

    @hookspec(firstresult=True)
    def pagedllm_memory_info(self, device: "torch.device") -> MemoryInfo:
        """REQUIRED. Total/free device memory, and whether pinned host memory exists."""

    @hookspec(firstresult=True)
    def pagedllm_memory_peak(self, device: "torch.device") -> Optional[int]:
        """Peak bytes allocated on ``device`` since the last call (and reset the counter), e.g. torch's device
        module's ``max_memory_allocated`` + ``reset_peak_memory_stats``. Core calls it around a profiling forward
        at the largest batch shape and sizes the KV pool from what is left. Default ``None``: no profiling (the pool
        comes from free memory after load, or ``MemoryInfo.default_kv_bytes``)."""

    @hookspec(firstresult=True)
    def pagedllm_distributed_backend(self) -> str:
        """torch.distributed backend name (gloo, or the name of the device's collective library). Default: gloo."""

    @hookspec(firstresult=True)
    def pagedllm_communicator(self, ranks: list[int], device: "torch.device", collective: str,
                              timeout_s: float) -> Any:
        """The :class:`~pagedllm.distributed.communicator.Communicator` for one tensor- or pipeline-parallel group of
        global ``ranks`` (called by every rank for every group, in the same order). ``collective`` is
        ``pagedllm_distributed_backend``'s answer; every wait must end within ``timeout_s``. Specialise it for a
        faster path (a shared-memory all-reduce on CPU, a device-native library). Default: ``TorchCommunicator``,
        torch.distributed on ``collective``."""

    @hookspec(firstresult=True)
    def pagedllm_set_device(self, device: "torch.device") -> None:
        """Make ``device`` current for this process (e.g. torch's device module's ``set_device``). Default: nothing."""

    @hookspec(firstresult=True)
    def pagedllm_synchronize(self, device: "torch.device") -> None:
        """Wait for queued device work (used by benchmarks and graph capture). Default: nothing."""

    # ---- engine shape (v2) -------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_update_config(self, config: "EngineConfig", model_info: ModelInfo) -> Optional[dict]:
        """Adjust the engine config before any weight is loaded: return ``{field: value}`` for ``block_size``,
        ``dtype``, ``max_num_batched_tokens``, ``max_num_seqs``, ``enforce_eager`` (others are refused), or raise
        :class:`~pagedllm.backend.ParamError` naming the field the device cannot run. ``config`` holds the
        user's values: each of those fields is ``None`` (``dtype``: ``"auto"``) when the user left it unset, so
        a user's ``max_num_seqs=256`` is told from the default; ``runner`` is already resolved (``generate`` or
        ``pooling``); core fills what stays unset afterwards (from the checkpoint, ``Capabilities`` and its
        defaults). Default: no change."""

    @hookspec(firstresult=True)
    def pagedllm_batch_policy(self, ctx: RunnerContext) -> "BatchPolicy":
        """The batch shapes the model may see: :class:`~pagedllm.backend.batch_policy.BatchPolicy` (identity, dynamic
        shapes) or :class:`~pagedllm.backend.batch_policy.BucketPolicy` (token count, sequence count and block-table width
        each padded to a bucket; every shape warmed up before serving). Used by the scheduler's budget and the model
        runner alike. ``ctx.policy`` is the identity here. Default: identity."""

    @hookspec(firstresult=True)
    def pagedllm_model_runner(self, ctx: RunnerContext, model: Any, kv: Any) -> Any:
        """Escape hatch: return an object with ``execute(scheduled) -> StepOutput`` (see ``pagedllm.worker.model_runner``) to own
        the whole step (input preparation, forward, logits, warm-up). ``model.kv_caches`` holds the caches; ``kv``
        is the block manager (``kv.block_ids(request_id)`` is a request's block table). Default ``None``: core's
        ``ModelRunner`` around the backend's graph runner."""

    # ---- KV cache ---------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_allocate_kv_cache(self, spec: KVCacheSpec) -> list:
        """Allocate one KV cache object per layer, in the layout this backend's kernels want.

        Default: canonical ``[2, num_blocks, block_size, num_kv_heads, head_size]`` zeros on ``spec.device``.
        """

    @hookspec(firstresult=True)
    def pagedllm_allocate_host_kv_cache(self, spec: KVCacheSpec, pin_memory: bool) -> list:
        """Host (CPU) caches for swapped-out blocks, in whatever layout ``pagedllm_swap_kv_blocks`` copies between;
        page-locked when ``pin_memory`` (core passes ``MemoryInfo.pinned_host``). Default: canonical layout; for a
        backend with its own ``pagedllm_allocate_kv_cache``, that allocator on the host spec, or no swap (preemption
        recomputes) where it cannot serve ``pagedllm_swap_kv_blocks`` (``registry.SwapUnsupported``)."""

    @hookspec(firstresult=True)
    def pagedllm_allocate_state_cache(self, spec: MambaSpec) -> list:
        """v3. Allocate the recurrent-state group: one entry per layer, each a tuple of tensors of logical shape
        ``[spec.num_slots, *spec.shapes[i]]`` and dtype ``spec.dtypes[i]`` on ``spec.device``, in this backend's
        memory layout. Core never clears a slot: a request starting fresh is flagged to the kernels
        (``has_initial_state`` false); it only copies whole slots to host and back under swap preemption, by
        indexing dimension 0 of each tensor. Default: contiguous zeros
        (``pagedllm.backend.conv_ops.allocate_state_cache``)."""

    @hookspec(firstresult=True)
    def pagedllm_allocate_kv_cache_groups(self, config: KVCacheConfig) -> dict:
        """v4. Allocate every group's caches at once, each group in this backend's own layout: returns ``{layer_id:
        cache}`` for exactly the layers of ``config.kv_cache_groups``. A paged layer's cache holds
        ``config.num_blocks`` blocks of its group's spec, indexed by the block ids and slots core hands the kernels
        (``write_kv`` / ``paged_attention``, or the MLA pair); layers may share a tensor as
        ``config.kv_cache_tensors`` says, or not. A state layer's cache is what ``pagedllm_allocate_state_cache``
        returns for one layer (a tuple of ``[num_slots, *shape]`` tensors). Core checks the return (every layer,
        device, dtype; the canonical shape where core's reference kernels read the cache) and refuses a bad one
        naming the backend and group. Default: ``pagedllm_allocate_kv_cache`` on one :class:`KVCacheSpec` of
        ``len(config.kv_cache_tensors)`` layers (tensor i viewed by ``kv_cache_tensors[i].shared_by``) plus
        ``pagedllm_allocate_state_cache`` for the state group — the backend's own allocators where it has them, so
        a v3 plugin's caches are unchanged (``pagedllm.backend.reference.kv_cache_groups_from``)."""

    @hookspec(firstresult=True)
    def pagedllm_causal_conv1d_fn(
        self, x: "torch.Tensor", weight: "torch.Tensor", bias: Optional["torch.Tensor"], conv_states: "torch.Tensor",
        query_start_loc: "torch.Tensor", state_indices: "torch.Tensor", has_initial_state: "torch.Tensor",
        activation: Optional[str],
    ) -> "torch.Tensor":
        """v3. Depthwise causal conv1d over prefill chunks (vLLM's ``causal_conv1d_fn``, token-major).

        ``x`` ``[T, dim]``: sequence i owns rows ``query_start_loc[i]:query_start_loc[i+1]`` (int32 ``[B+1]``);
        ``weight`` ``[dim, width]``; ``bias`` ``[dim]`` or None; ``conv_states`` ``[num_slots, dim, width - 1]`` from
        ``pagedllm_allocate_state_cache``. Sequence i reads and writes slot ``state_indices[i]`` (int32 ``[B]``; -1:
        a padding sequence, skipped). Its input is the slot's ``width - 1`` previous inputs when
        ``has_initial_state[i]`` (bool ``[B]``: the chunk continues the sequence), else ``width - 1`` zeros, then its
        rows; ``out[t, c] = act(bias[c] + sum_k weight[c, k] * in[t + k, c])`` over that padded input, ``act`` silu
        for ``activation="silu"``, identity for None. Afterwards the slot holds the last ``width - 1`` inputs of that
        padded input (the chunk's last rows, preceded by the old state when the chunk is shorter). Returns ``[T, dim]``
        in x's dtype. Reference: ``pagedllm.backend.conv_ops.causal_conv1d_fn``."""

    @hookspec(firstresult=True)
    def pagedllm_causal_conv1d_update(
        self, x: "torch.Tensor", conv_states: "torch.Tensor", weight: "torch.Tensor", bias: Optional["torch.Tensor"],
        activation: Optional[str], state_indices: "torch.Tensor",
    ) -> "torch.Tensor":
        """v3. One decode token per sequence (vLLM's ``causal_conv1d_update``): ``x`` ``[B, dim]``, row i continuing
        slot ``state_indices[i]`` (-1: padding, skipped): output as ``pagedllm_causal_conv1d_fn`` on a one-token chunk
        with initial state, and the slot shifted left by one with ``x[i]`` appended. Returns ``[B, dim]``.
        Reference: ``pagedllm.backend.conv_ops.causal_conv1d_update``."""

    @hookspec(firstresult=True)
    def pagedllm_write_kv(
        self, key: "torch.Tensor", value: "torch.Tensor", kv_cache: Any, slot_mapping: "torch.Tensor",
        k_scale: float, v_scale: float,
    ) -> None:
        """Store new keys/values ``[num_tokens, num_kv_heads, head_size]`` at flat slots
        ``slot = block_id * block_size + offset``; a slot of -1 means "skip this token" (padding). An fp8 cache
        (``Capabilities.kv_cache_dtypes``) stores ``saturate(key * (1 / k_scale))`` and likewise values with
        ``v_scale``, rounded to nearest-even (``pagedllm.backend.kv_quant.quantize_kv``); other caches ignore the scales."""

    @hookspec(firstresult=True)
    def pagedllm_paged_attention(
        self,
        query: "torch.Tensor",
        kv_cache: Any,
        meta: "AttentionMetadata",
        scale: float,
        sliding_window: Optional[int],
        soft_cap: Optional[float],
        k_scale: float,
        v_scale: float,
        alibi_slopes: Optional["torch.Tensor"] = None,
        sinks: Optional["torch.Tensor"] = None,
    ) -> "torch.Tensor":
        """Attention for a flat batch mixing decodes and prefill chunks with cached context.

        ``query`` is ``[num_tokens, num_heads, head_size]``; sequence i owns query rows
        ``meta.query_start_loc[i]:meta.query_start_loc[i+1]``, which are its *last* tokens: token j of the chunk sits at
        position ``seq_len - query_len + j`` and attends causally to positions ``<= `` its own, read from the cache
        through ``meta.block_tables[i]`` (the new K/V were already written by ``pagedllm_write_kv``). GQA: query
        head h uses kv head ``h // (num_heads // num_kv_heads)``. ``sliding_window`` W keeps keys with
        ``q_pos - k_pos < W``. ``soft_cap`` c maps scores s to ``c * tanh(s / c)``. An fp8 cache is read as
        ``stored * k_scale`` (keys) and ``stored * v_scale`` (values); other caches ignore the scales. Returns
        ``[num_tokens, num_heads, head_size]`` in the query's dtype. ``alibi_slopes`` (float32 ``[num_heads]``, optional keyword; only
        passed to backends whose ``Capabilities.alibi`` is set) adds the ALiBi bias ``slope_h * (k_pos - q_pos)`` to head
        h's scaled scores. ``sinks`` (float32 ``[num_heads]``, optional keyword; only passed to backends whose
        ``Capabilities.attention_sinks`` is set) is GPT-OSS's learned sink logit: a virtual key with a zero value that
        joins every softmax of head h with the raw logit ``sinks[h]`` (not scaled, capped or masked; window and
        causality apply to the real keys only), so ``p_s = exp(score_s) / (exp(sinks[h]) + sum_s' exp(score_s'))``
        and the probabilities of the real keys sum to less than 1. ``meta.mm_prefix_ranges`` (set only for backends
        whose ``Capabilities.mm_prefix_lm`` is set): per sequence, position ranges ``[start, end)`` within which keys
        after the query are visible too (OR-ed with causality before the window applies: HF Gemma 3's
        ``AND(sliding_window, OR(causal, same image))``).
        """

    @hookspec(firstresult=True)
    def pagedllm_encoder_attention(
        self,
        query: "torch.Tensor",
        key: "torch.Tensor",
        value: "torch.Tensor",
        cu_seqlens: "torch.Tensor",
        max_seqlen: int,
        scale: float,
        causal: bool,
    ) -> "torch.Tensor":
        """Varlen, unpaged attention for encoders (BERT-style embedding and cross-encoder models; later vision
        towers): flash-attn's ``varlen`` shape, no KV cache read or written.

        ``query`` ``[T, num_heads, head_size]``, ``key`` / ``value`` ``[T, num_kv_heads, head_size]`` (GQA: query
        head h uses kv head ``h // (num_heads // num_kv_heads)``); sequence i owns rows
        ``cu_seqlens[i]:cu_seqlens[i+1]`` of all three (``cu_seqlens`` int32 ``[B+1]`` on the query's device,
        starting at 0; ``max_seqlen`` the longest sequence, for kernels that size a grid by it). Each row attends to
        every row of its own sequence (bidirectional) when ``causal`` is false, to those at or before it when true;
        never across sequences. Scores are ``scale * q . k``. Rows past ``cu_seqlens[-1]`` are padding (any output).
        Returns ``[T, num_heads, head_size]`` in the query's dtype. Reference: ``ref_ops.encoder_attention``; a
        backend without it runs that reference, so older plugins keep loading."""

    @hookspec(firstresult=True)
    def pagedllm_write_mla_kv(self, latent: "torch.Tensor", kv_cache: Any, slot_mapping: "torch.Tensor") -> None:
        """MLA: store each new token's latent row ``[num_tokens, head_size]`` (the normed compressed KV, then the
        rotated shared rope key) at its flat slot; -1 skips. ``kv_cache`` came from an ``mla`` ``KVCacheSpec``."""

    @hookspec(firstresult=True)
    def pagedllm_mla_attention(self, query: "torch.Tensor", kv_cache: Any, meta: "AttentionMetadata", scale: float,
                               value_size: int) -> "torch.Tensor":
        """MLA attention in the absorbed form (vLLM's MLA decode path): every query head attends to the one latent
        row per cached token. ``query`` ``[num_tokens, num_heads, head_size]`` (the no-rope query already multiplied
        into latent space by the key up-projection, then the rotated rope query); scores ``scale * query . row``,
        causal over the sequence exactly as ``pagedllm_paged_attention``; values are the rows' first ``value_size``
        features (the latent). Returns ``[num_tokens, num_heads, value_size]`` in the query's dtype; the model
        applies the value up-projection. Reference: ``pagedllm.backend.ref_ops.mla_attention``."""

    @hookspec(firstresult=True)
    def pagedllm_gather_kv_blocks(self, kv_cache: Any, block_ids: "torch.Tensor") -> "torch.Tensor":
        """Read blocks back in canonical layout ``[2, n, block_size, num_kv_heads, head_size]``."""

    @hookspec(firstresult=True)
    def pagedllm_swap_kv_blocks(
        self, src_caches: list, dst_caches: list, src: "torch.Tensor", dst: "torch.Tensor"
    ) -> None:
        """Copy blocks ``src[i]`` of ``src_caches`` to blocks ``dst[i]`` of ``dst_caches`` (one cache per layer each),
        between the device caches and the host caches of ``pagedllm_allocate_host_kv_cache``, in either direction.
        ``src`` / ``dst`` are int64 block-id tensors, on the host or on a cache's device: move them where your copy
        needs them."""

    # ---- graph capture ----------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_graph_runner(self, model: Any, max_num_seqs: int, device: "torch.device",
                              ctx: RunnerContext) -> GraphRunner:
        """Wrap the model forward in this backend's capture strategy (device graphs, compiled buckets,
        torch.compile). Default: eager. Graphs must read metadata from persistent buffers they own. ``ctx`` (v2)
        carries the engine's max_model_len, block size, budgets, dtype and batch policy; core warms up every
        ``ctx.policy.warmup_shapes()`` shape through ``run`` (and ``sample``) right after this returns, with separate
        ``input_ids`` and ``positions`` tensors as in a real step. What the model reads inside a captured graph, so
        what must live in persistent buffers: :class:`~pagedllm.backend.attention.AttentionMetadata`."""

    # ---- optional fused ops (fall back to reference) ------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_rms_norm(self, x: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
        """RMSNorm, computed in float32 and cast back, as HF does."""

    @hookspec(firstresult=True)
    def pagedllm_fused_add_rms_norm(self, x: "torch.Tensor", residual: "torch.Tensor", weight: "torch.Tensor",
                                    eps: float) -> tuple:
        """vLLM's ``fused_add_rms_norm`` as the decoder uses it: ``x += residual`` in x's dtype (in place: x becomes
        the residual stream), then ``rms_norm(x, weight, eps)``. Returns ``(normed, x)``; ``residual`` is not
        written. ``[T, hidden]`` tensors. Reference: ``pagedllm.backend.ref_ops.fused_add_rms_norm``."""

    @hookspec(firstresult=True)
    def pagedllm_rotary(
        self, positions: "torch.Tensor", query: "torch.Tensor", key: "torch.Tensor", cos_sin_cache: "torch.Tensor"
    ) -> tuple:
        """Neox-style rotary (HF ``rotate_half``) on ``[T, H, D]`` q and k; ``cos_sin_cache`` is
        ``[max_pos, D]`` = cat(cos, sin) over the rotary half-dim. Returns new (query, key)."""

    @hookspec(firstresult=True)
    def pagedllm_silu_and_mul(self, x: "torch.Tensor") -> "torch.Tensor":
        """``silu(x[..., :d]) * x[..., d:]`` for the gated MLP."""

    @hookspec(firstresult=True)
    def pagedllm_apply_token_bitmask(self, logits: "torch.Tensor", bitmask: "torch.Tensor") -> None:
        """Structured outputs: in place, set ``logits[i, t]`` to -inf where bit ``t % 32`` of ``bitmask[i, t // 32]``
        is 0. ``logits`` ``[R, V]`` float32; ``bitmask`` int32 ``[R, ceil(W / 32)]`` on the logits' device, where
        ``W`` (the tokenizer's vocab padded to the model's) may differ from ``V``: tokens past the mask are
        disallowed, mask bits past ``V`` ignored. xgrammar's layout, so its kernels drop in."""

    @hookspec(firstresult=True)
    def pagedllm_add_lora(self, y: "torch.Tensor", x: "torch.Tensor", lora_a: "torch.Tensor",
                          lora_b: "torch.Tensor", mapping: Any) -> None:
        """Multi-LoRA shrink + expand, in place: ``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` for each token t whose
        slot ``s = mapping.token_indices[t]`` is >= 0 (-1: base model, untouched). ``y`` ``[T, out]``, ``x``
        ``[T, in]``, ``lora_a`` ``[max_loras, R, in]``, ``lora_b`` ``[max_loras, out, R]`` with the scaling folded
        in. ``mapping`` (``pagedllm.backend.LoRAMapping``) also gives the contiguous runs of tokens per slot and,
        when they are adjacent and equally long, a grid view for batched kernels, built on the host once per step.
        Reference: ``pagedllm.backend.add_lora_reference`` (vLLM's sgmv/bgmv shrink + expand)."""

    # ---- quantization -------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_quantized_linear(self, method: str, weight_type: str) -> Optional[QuantizedLinearKernel]:
        """The backend's kernel for linear layers quantized with ``method`` (a vLLM name declared in
        ``Capabilities.quantization``) and ``weight_type`` (GGUF: ``Q4_0``, ``Q4_1``, ``Q8_0``, ``Q4_K``...), or
        ``None``: core then runs its reference (dequantize, then matmul; ``pagedllm.quantization``), logs once that
        this backend has no such kernel, and the conformance suite compares every kernel against that reference.
        ``method="unquantized"`` (vLLM's ``UnquantizedLinearMethod``) with the dtype's name as ``weight_type`` asks
        for the backend's dense kernel (e.g. weights pre-packed once for oneDNN); ``None`` keeps ``F.linear``."""


    @hookspec(firstresult=True)
    def pagedllm_fused_moe(self, hidden_states: "torch.Tensor", w13: "torch.Tensor", w2: "torch.Tensor",
                           topk_weights: "torch.Tensor", topk_ids: "torch.Tensor") -> "torch.Tensor":
        """Mixture-of-experts MLP after routing (vLLM's ``fused_experts``): for each token t and each of its k
        chosen experts e = ``topk_ids[t, j]``, ``out[t] += topk_weights[t, j] * w2[e] @ (silu(g) * u)`` where
        ``g, u = split(w13[e] @ hidden_states[t])``. ``hidden_states`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows
        then up rows); ``w2`` ``[E, H, I]``; ``topk_weights`` float32 and ``topk_ids`` int64, both ``[T, k]``.
        Returns ``[T, H]`` in the hidden states' dtype. Reference: ``pagedllm.backend.ref_ops.fused_moe``."""

    # ---- recurrent-state ops: Mamba2 and Gated DeltaNet (fall back to reference) ---------------------------------
    # Decode ops update a state cache ``[num_slots, ...]`` in place at ``state_indices`` (int ``[batch]``, -1:
    # padding row, neither read nor written, output zero; other slots untouched); prefill ops are functional: initial
    # states in (zeros for a fresh sequence), final states out, one per sequence of ``cu_seqlens`` (int ``[N + 1]``).
    # Arithmetic in float32; outputs in the activations' dtype. Exact meaning: the reference modules' docstrings.
    @hookspec(firstresult=True)
    def pagedllm_selective_state_update(
        self, state: "torch.Tensor", x: "torch.Tensor", dt: "torch.Tensor", A: "torch.Tensor", B: "torch.Tensor",
        C: "torch.Tensor", D: Optional["torch.Tensor"], z: Optional["torch.Tensor"],
        dt_bias: Optional["torch.Tensor"], dt_softplus: bool, state_indices: "torch.Tensor",
    ) -> "torch.Tensor":
        """Mamba2 decode, vLLM's ``selective_state_update`` with per-head ``dt``/``A``/``D``/``dt_bias`` (its tied
        form): one token per sequence. ``state`` ``[num_slots, heads, head_dim, d_state]`` (any float dtype,
        updated in place at ``state_indices``); ``x`` / ``z`` ``[batch, heads, head_dim]``; ``dt`` ``[batch,
        heads]``; ``A`` / ``D`` / ``dt_bias`` ``[heads]``; ``B`` / ``C`` ``[batch, groups, d_state]``. ``dt`` +=
        ``dt_bias``, softplus when ``dt_softplus``; ``state = state * exp(dt * A) + dt * x (outer) B``; ``y = state
        @ C + D * x``, times ``silu(z)`` when given. Returns ``[batch, heads, head_dim]`` in ``x``'s dtype.
        Reference: ``pagedllm.backend.ssm_ops.selective_state_update``."""

    @hookspec(firstresult=True)
    def pagedllm_mamba_chunk_scan_combined(
        self, x: "torch.Tensor", dt: "torch.Tensor", A: "torch.Tensor", B: "torch.Tensor", C: "torch.Tensor",
        chunk_size: int, cu_seqlens: "torch.Tensor", initial_states: Optional["torch.Tensor"],
        D: Optional["torch.Tensor"], z: Optional["torch.Tensor"], dt_bias: Optional["torch.Tensor"],
        dt_softplus: bool, dt_limit: tuple,
    ) -> tuple:
        """Mamba2 prefill, vLLM's ``mamba_chunk_scan_combined_varlen`` (SSD): the flat chunk ``x`` / ``z`` ``[T,
        heads, head_dim]``, ``dt`` ``[T, heads]``, ``B`` / ``C`` ``[T, groups, d_state]`` split by ``cu_seqlens``;
        sequence i starts from ``initial_states[i]`` (``[N, heads, head_dim, d_state]``; ``None``: zeros). ``dt`` as
        in ``pagedllm_selective_state_update``, then clamped to ``dt_limit`` ``(min, max)``. ``chunk_size`` only
        tiles the work. Returns ``(out [T, heads, head_dim]`` in ``x``'s dtype, ``final_states [N, heads,
        head_dim, d_state]`` float32``)``. Reference: ``pagedllm.backend.ssm_ops.mamba_chunk_scan_combined``."""

    @hookspec(firstresult=True)
    def pagedllm_chunk_gated_delta_rule(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
        scale: Optional[float], initial_state: Optional["torch.Tensor"], cu_seqlens: "torch.Tensor",
        use_qk_l2norm_in_kernel: bool,
    ) -> tuple:
        """Gated DeltaNet prefill (Qwen3-Next, Qwen3.5), flash-linear-attention's ``chunk_gated_delta_rule`` in
        varlen form without its batch of 1: ``q`` / ``k`` ``[T, H, K]``, ``v`` ``[T, HV, V]`` (value head i reads
        q/k head ``i // (HV // H)``), ``g`` (log decay) / ``beta`` ``[T, HV]``, split by ``cu_seqlens``; sequence i
        starts from ``initial_state[i]`` (``[N, HV, K, V]``; ``None``: zeros). q and k L2-normalised first when
        ``use_qk_l2norm_in_kernel``; q times ``scale`` (``None``: ``K ** -0.5``). Per token: ``S *= exp(g)``; ``S +=
        k (outer) beta * (v - k @ S)``; ``o = q @ S``. Returns ``(o [T, HV, V]`` in ``v``'s dtype, ``final_state
        [N, HV, K, V]`` float32``)``. Reference: ``pagedllm.backend.delta_rule_ops.chunk_gated_delta_rule``."""

    @hookspec(firstresult=True)
    def pagedllm_fused_recurrent_gated_delta_rule(
        self, q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
        scale: Optional[float], state: "torch.Tensor", state_indices: "torch.Tensor", use_qk_l2norm_in_kernel: bool,
    ) -> "torch.Tensor":
        """Gated DeltaNet decode, FLA's ``fused_recurrent_gated_delta_rule`` as vLLM calls it
        (``inplace_final_state``, ``ssm_state_indices``): one token per sequence, ``q`` / ``k`` ``[batch, H, K]``,
        ``v`` ``[batch, HV, V]``, ``g`` / ``beta`` ``[batch, HV]``; ``state`` ``[num_slots, HV, K, V]`` (any float
        dtype) updated in place at ``state_indices``, the step of ``pagedllm_chunk_gated_delta_rule``. Returns
        ``[batch, HV, V]`` in ``v``'s dtype. Reference:
        ``pagedllm.backend.delta_rule_ops.fused_recurrent_gated_delta_rule``."""


class RetiredSpec:
    """Hooks core no longer calls (see the module docstring): specs kept only so plugins written against an older
    contract that still implement them keep loading. Never bound on a ``Backend``, never called."""

    @hookspec(firstresult=True)
    def pagedllm_copy_kv_blocks(self, kv_caches: list, src: "torch.Tensor", dst: "torch.Tensor") -> None:
        """Retired during v2 (was: copy whole blocks ``src[i] -> dst[i]`` in every layer). Core shares only full
        blocks through the prefix cache and beam search recomputes its forks, so no block is ever copied on the
        device (as in vLLM v1, whose attention backends dropped ``copy_blocks``)."""


#: Hooks every backend must implement itself (no reference fallback).
REQUIRED_HOOKS = ("pagedllm_backend_info", "pagedllm_probe", "pagedllm_memory_info")
#: Every hook of the contract, in spec order (core binds each once per backend: see ``backends.Backend``).
HOOK_NAMES = tuple(n for n in vars(BackendSpec) if n.startswith("pagedllm_"))
#: Retired hooks: a plugin may still implement them (it loads, with a DeprecationWarning); core never calls them.
RETIRED_HOOK_NAMES = tuple(n for n in vars(RetiredSpec) if n.startswith("pagedllm_"))
