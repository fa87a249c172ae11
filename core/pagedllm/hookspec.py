"""The backend contract: every hook a pagedllm backend may implement, in one file.

A backend is a pluggy plugin (a module or object with ``@hookimpl`` functions) published under the
``pagedllm.backends`` entry-point group. Core builds one :class:`pluggy.PluginManager` per backend holding that
backend and core's reference plugin (``pagedllm.reference_plugin``, registered ``trylast``), so every optional hook
falls back to core's pure-torch reference ops. Hooks are resolved once, when the backend is selected; the hot path
calls plain functions, not pluggy.

Contract version: :data:`API_VERSION`. Core N loads plugins built for N or N-1 (``BackendInfo.api_version``) and
refuses others with a message naming both versions. Hooks are only ever added, never changed in place: a changed
signature is a new hook name and a new API version.

KV-cache layout is the backend's choice. The *canonical* layout, used by the reference ops and by the conformance
suite, is one tensor per layer of shape ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (index 0 = keys,
1 = values). A backend with another layout implements ``pagedllm_gather_kv_blocks`` so conformance can read it back,
and ``pagedllm_copy_kv_blocks`` / ``pagedllm_swap_kv_blocks`` so core can copy-on-write and swap.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from pagedllm.attention import AttentionMetadata

PROJECT = "pagedllm"
API_VERSION = 1
ENTRY_POINT_GROUP = "pagedllm.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class BackendInfo:
    """Identity. ``device_type`` is the torch device type (``cpu``, ``cuda``, ``xpu``, ``npu``, ``hpu``, ``xla``)."""

    name: str
    device_type: str
    priority: int = 0  # `--device auto` picks the usable backend with the highest priority
    api_version: int = API_VERSION
    extra: str = ""  # the pip extra that installs it, e.g. "cuda" for `pip install pagedllm[cuda]`
    description: str = ""


@dataclass(frozen=True)
class ProbeResult:
    """Whether the backend can run here, and if not, why (driver missing, no device, SDK mismatch...)."""

    usable: bool
    reason: str = ""
    device_name: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What the backend's kernels support; core checks a model/config against this before running."""

    dtypes: tuple[str, ...] = ("float32",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    head_sizes: tuple[int, ...] = (64, 128)
    block_sizes: tuple[int, ...] = (16,)
    # none: eager only; decode: decode-only graphs (like vLLM's UNIFORM_SINGLE_TOKEN_DECODE); full: any batch
    graph_capture: str = "none"
    sliding_window: bool = True
    soft_cap: bool = True
    quantization: tuple[str, ...] = ()


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
    """What core asks the allocator for: one cache per layer holding ``num_blocks`` blocks."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: Any  # torch.dtype
    device: Any  # torch.device

    @property
    def bytes_per_block(self) -> int:
        import torch

        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * elem


@dataclass
class GraphRunner:
    """Returned by ``pagedllm_graph_runner``: ``run(input_ids, positions, meta) -> hidden_states``.

    ``level`` says what it captured (``none``, ``decode``, ``full``, ``compile``); ``stats`` is free-form.
    """

    run: Callable[..., "torch.Tensor"]
    level: str = "none"
    stats: dict = field(default_factory=dict)


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
        """Dtypes, KV dtypes, head/block sizes, graph-capture level, quantization methods. Default: conservative."""

    @hookspec(firstresult=True)
    def pagedllm_memory_info(self, device: "torch.device") -> MemoryInfo:
        """REQUIRED. Total/free device memory, and whether pinned host memory exists."""

    @hookspec(firstresult=True)
    def pagedllm_distributed_backend(self) -> str:
        """torch.distributed backend name (gloo, nccl, hccl, xccl...). Default: gloo."""

    @hookspec(firstresult=True)
    def pagedllm_set_device(self, device: "torch.device") -> None:
        """Make ``device`` current for this process (e.g. ``torch.cuda.set_device``). Default: nothing."""

    @hookspec(firstresult=True)
    def pagedllm_synchronize(self, device: "torch.device") -> None:
        """Wait for queued device work (used by benchmarks and graph capture). Default: nothing."""

    # ---- KV cache ---------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_allocate_kv_cache(self, spec: KVCacheSpec) -> list:
        """Allocate one KV cache object per layer, in the layout this backend's kernels want.

        Default: canonical ``[2, num_blocks, block_size, num_kv_heads, head_size]`` zeros on ``spec.device``.
        """

    @hookspec(firstresult=True)
    def pagedllm_write_kv(
        self, key: "torch.Tensor", value: "torch.Tensor", kv_cache: Any, slot_mapping: "torch.Tensor"
    ) -> None:
        """Store new keys/values ``[num_tokens, num_kv_heads, head_size]`` at flat slots
        ``slot = block_id * block_size + offset``; a slot of -1 means "skip this token" (padding)."""

    @hookspec(firstresult=True)
    def pagedllm_paged_attention(
        self,
        query: "torch.Tensor",
        kv_cache: Any,
        meta: "AttentionMetadata",
        scale: float,
        sliding_window: Optional[int],
        soft_cap: Optional[float],
    ) -> "torch.Tensor":
        """Attention for a flat batch mixing decodes and prefill chunks with cached context.

        ``query`` is ``[num_tokens, num_heads, head_size]``; sequence i owns query rows
        ``meta.query_start_loc[i]:meta.query_start_loc[i+1]``, which are its *last* tokens: token j of the chunk sits at
        position ``seq_len - query_len + j`` and attends causally to positions ``<= `` its own, read from the cache
        through ``meta.block_tables[i]`` (the new K/V were already written by ``pagedllm_write_kv``). GQA: query
        head h uses kv head ``h // (num_heads // num_kv_heads)``. ``sliding_window`` W keeps keys with
        ``q_pos - k_pos < W``. ``soft_cap`` c maps scores s to ``c * tanh(s / c)``. Returns ``[num_tokens, num_heads,
        head_size]`` in the query's dtype.
        """

    @hookspec(firstresult=True)
    def pagedllm_gather_kv_blocks(self, kv_cache: Any, block_ids: "torch.Tensor") -> "torch.Tensor":
        """Read blocks back in canonical layout ``[2, n, block_size, num_kv_heads, head_size]``."""

    @hookspec(firstresult=True)
    def pagedllm_copy_kv_blocks(self, kv_caches: list, src: "torch.Tensor", dst: "torch.Tensor") -> None:
        """Copy whole blocks ``src[i] -> dst[i]`` in every layer (copy-on-write, beam forks)."""

    @hookspec(firstresult=True)
    def pagedllm_swap_kv_blocks(
        self, src_caches: list, dst_caches: list, src: "torch.Tensor", dst: "torch.Tensor"
    ) -> None:
        """Copy blocks between a device cache and a host (pinned) cache, in either direction."""

    # ---- graph capture ----------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_graph_runner(self, model: Any, max_num_seqs: int, device: "torch.device") -> GraphRunner:
        """Wrap the model forward in this backend's capture strategy (CUDA/HIP/NPU/HPU graphs, XLA buckets,
        torch.compile). Default: eager. Graphs must read metadata from persistent buffers they own."""

    # ---- optional fused ops (fall back to reference) ------------------------------------------------
    @hookspec(firstresult=True)
    def pagedllm_rms_norm(self, x: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
        """RMSNorm, computed in float32 and cast back, as HF does."""

    @hookspec(firstresult=True)
    def pagedllm_rotary(
        self, positions: "torch.Tensor", query: "torch.Tensor", key: "torch.Tensor", cos_sin_cache: "torch.Tensor"
    ) -> tuple:
        """Neox-style rotary (HF ``rotate_half``) on ``[T, H, D]`` q and k; ``cos_sin_cache`` is
        ``[max_pos, D]`` = cat(cos, sin) over the rotary half-dim. Returns new (query, key)."""

    @hookspec(firstresult=True)
    def pagedllm_silu_and_mul(self, x: "torch.Tensor") -> "torch.Tensor":
        """``silu(x[..., :d]) * x[..., d:]`` for the gated MLP."""


#: Hooks every backend must implement itself (no reference fallback).
REQUIRED_HOOKS = ("pagedllm_backend_info", "pagedllm_probe", "pagedllm_memory_info")
#: Hooks the model runner calls on the hot path, resolved once to plain functions.
OP_HOOKS = (
    "pagedllm_write_kv",
    "pagedllm_paged_attention",
    "pagedllm_rms_norm",
    "pagedllm_rotary",
    "pagedllm_silu_and_mul",
)
