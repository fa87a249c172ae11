"""The TPU backend's hook implementations (entry point ``tpu`` in group ``pagedllm.backends``).

Stack: JAX (see docs/backends/tpu.md for why not torch-xla). The backend owns the step through
``pagedllm_model_runner`` (a jitted JAX program per bucket shape, :mod:`pagedllm_tpu.runner`); core still loads the
torch model (the runner takes its weights), schedules, pads with the backend's ``BucketPolicy`` and sizes the pool.
The tensor-level hooks (``write_kv``, ``paged_attention``, fused ops, block gather/swap) bridge torch tensors to
the very JAX functions the runner traces, so core's conformance suite checks those functions against its reference
ops. Importing this module imports neither jax nor any TPU runtime: the probe does, lazily.
"""

from __future__ import annotations

import glob
import os
from typing import Any, Optional

import numpy as np
import torch

from pagedllm.backend.batch_policy import BucketPolicy, capped_pow2_buckets
from pagedllm.backend.hookspec import (API_VERSION, BackendInfo, Capabilities, KVCacheSpec, MemoryInfo, ModelInfo,
                               ProbeResult, RunnerContext, hookimpl)
from pagedllm.backend import ParamError
from pagedllm_tpu import kv_cache as kvc
from pagedllm_tpu import platform

#: Smallest token bucket and sequence bucket: tpu-inference pads tokens from 16 and requests from MIN_NUM_SEQS = 8
#: (``tpu_inference/runner/utils.py``: get_token_paddings, get_req_paddings).
MIN_TOKEN_BUCKET = 16
MIN_SEQ_BUCKET = 8
#: Host backends share RAM: on JAX's CPU device the pool defaults to at most this much (like the cpu backend).
_CPU_DEFAULT_KV_BYTES = 4 << 30
#: Weight bytes expected on the device once the runner places them (set by update_config; the pool is sized before).
_state: dict = {"weight_bytes": 0}


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="tpu", device_type="cpu", priority=50, api_version=API_VERSION, extra="tpu",
                       description="Google TPU through JAX/XLA: bucketed static shapes, ragged paged attention, "
                                   "XLA compilation cache (torch tensors stay on the host)")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    usable, reason, name = platform.probe()
    return ProbeResult(usable, reason, name)


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    return Capabilities(
        dtypes=("bfloat16", "float32"),  # the MXU's native type first
        kv_cache_dtypes=("auto",),
        head_sizes=None,  # the jnp attention takes any head size (the Pallas kernel pads to 128 lanes)
        block_sizes=(16, 32, 64, 128),
        graph_capture="full",  # every step is a compiled XLA program
        sliding_window=True,
        soft_cap=True,
        mla=False,  # its own KV layout ignores KVCacheSpec.mla
        on_device_sampling=True,
    )


def _checkpoint_weight_bytes(model_path: str, run_dtype: str, ckpt_dtype: str) -> int:
    """Bytes the weights will take on the device: safetensors sizes scaled from the checkpoint to the run dtype."""
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    if os.path.isfile(model_path):  # GGUF: dequantized on load; the file size x 4 bounds float32 from above
        return os.path.getsize(model_path) * (2 if run_dtype != "float32" else 4)
    files = glob.glob(os.path.join(model_path, "*.safetensors"))
    total = sum(os.path.getsize(f) for f in files)
    return total * size.get(run_dtype, 4) // size.get(ckpt_dtype, 4)


@hookimpl
def pagedllm_update_config(config: Any, model_info: ModelInfo) -> Optional[dict]:
    """``dtype="auto"`` runs bfloat16 on a TPU (the MXU's type; a float32 checkpoint would otherwise run at a
    fraction of its speed), the checkpoint's dtype on XLA CPU (exact parity with HF). Remembers the weight bytes so
    ``memory_info`` can leave room for them: the runner places the weights after core sizes the pool."""
    from pagedllm_tpu import mesh

    n = mesh.tp_size()
    if model_info.num_heads % n or model_info.num_kv_heads % n:
        raise ParamError("model", f"{mesh.TP_ENV}={n} must divide the attention heads ({model_info.num_heads}) "
                                  f"and KV heads ({model_info.num_kv_heads}): each device holds whole heads")
    changes: dict = {}
    dtype = config.dtype
    if dtype == "auto":
        dtype = "bfloat16" if platform.on_tpu() else (model_info.dtype if model_info.dtype in ("float32",
                                                                                              "bfloat16")
                                                      else "float32")
        changes["dtype"] = dtype
    try:
        _state["weight_bytes"] = _checkpoint_weight_bytes(str(config.model), dtype, model_info.dtype)
    except (OSError, TypeError):
        _state["weight_bytes"] = 0
    return changes or None


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    total, free = platform.memory_stats()
    if platform.on_tpu():
        # The JAX weights are not on the device yet when core sizes the pool (after loading the torch model).
        return MemoryInfo(total_bytes=total, free_bytes=max(0, free - _state["weight_bytes"]), pinned_host=False)
    return MemoryInfo(total_bytes=total, free_bytes=free, pinned_host=False,
                      default_kv_bytes=min(_CPU_DEFAULT_KV_BYTES, int(free * 0.4)))


@hookimpl
def pagedllm_distributed_backend() -> str:
    return "gloo"  # host-side only; device collectives are XLA's (jax.sharding), not torch.distributed


@hookimpl
def pagedllm_synchronize(device: torch.device) -> None:
    import jax

    jax.effects_barrier()


@hookimpl
def pagedllm_batch_policy(ctx: RunnerContext) -> BucketPolicy:
    """Tokens and sequences in power-of-two buckets (from 16 and 8); one block-table width covering
    ``max_model_len``, as tpu-inference's fixed ``pages_per_seq``. Compilations = reachable (tokens, seqs) pairs."""
    return BucketPolicy(token_buckets=capped_pow2_buckets(ctx.max_num_batched_tokens, MIN_TOKEN_BUCKET),
                        seq_buckets=capped_pow2_buckets(ctx.max_num_seqs, MIN_SEQ_BUCKET),
                        block_buckets=(-(-ctx.max_model_len // ctx.block_size),),
                        block_size=ctx.block_size)


@hookimpl
def pagedllm_model_runner(ctx: RunnerContext, model: Any, kv: Any) -> Any:
    from pagedllm_tpu.runner import TPUModelRunner

    return TPUModelRunner(ctx, model, kv)


# ---- KV cache --------------------------------------------------------------------------------------------------------
@hookimpl
def pagedllm_allocate_kv_cache(spec: KVCacheSpec) -> list:
    """One :class:`~pagedllm_tpu.kv_cache.JaxKVCache` per layer, filled with NaN and committed to the mesh (an
    uncommitted array would key a different compiled program than the step's committed outputs). NaN, not zeros:
    a kernel that reads a slot nobody wrote shows NaN instead of a plausible value (tpu-inference zero-fills; the
    fill costs the same), and conformance's read-back compares unwritten slots as NaN."""
    import jax
    import jax.numpy as jnp

    from pagedllm_tpu import mesh

    shape = kvc.cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    # Created in place, already split by KV head over the mesh (PAGEDLLM_TPU_TP; one device by default).
    fill = jax.jit(lambda: jnp.full(shape, jnp.nan, kvc.jax_dtype(spec.dtype)), out_shardings=mesh.kv_sharding())
    return [kvc.JaxKVCache(fill()) for _ in range(spec.num_layers)]


@hookimpl
def pagedllm_allocate_host_kv_cache(spec: KVCacheSpec, pin_memory: bool) -> list:
    """Host swap space as numpy arrays in the device layout (JAX stages host transfers itself: no pinning)."""
    shape = kvc.cache_shape(spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return [np.full(shape, np.nan, kvc.jax_dtype(spec.dtype)) for _ in range(spec.num_layers)]


@hookimpl
def pagedllm_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: Any, slot_mapping: torch.Tensor) -> None:
    kv_cache.array = _jit("write_kv")(kv_cache.array, kvc.to_jax(key), kvc.to_jax(value),
                                      kvc.to_jax(slot_mapping.to(torch.int32)))


@hookimpl
def pagedllm_paged_attention(query: torch.Tensor, kv_cache: Any, meta: Any, scale: float,
                             sliding_window: Optional[int], soft_cap: Optional[float],
                             alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The runner's ragged paged attention on core's metadata (``block_tables`` are the page indices)."""
    if alibi_slopes is not None:
        raise NotImplementedError("this backend does not declare Capabilities.alibi")
    out = _jit("attention", scale, sliding_window, soft_cap)(
        kvc.to_jax(query), kv_cache.array, kvc.to_jax(meta.seq_lens.to(torch.int32)),
        kvc.to_jax(meta.block_tables.to(torch.int32)), kvc.to_jax(meta.query_start_loc.to(torch.int32)))
    return kvc.to_torch(out, query.dtype)


@hookimpl
def pagedllm_gather_kv_blocks(kv_cache: Any, block_ids: torch.Tensor) -> torch.Tensor:
    return kvc.gather_blocks(kv_cache, block_ids)


@hookimpl
def pagedllm_swap_kv_blocks(src_caches: list, dst_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    kvc.swap_blocks(src_caches, dst_caches, src, dst)


# ---- fused ops: the runner's jnp functions, bridged for conformance ----------------------------------------------------
@hookimpl
def pagedllm_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kvc.to_torch(_jit("rms_norm", eps)(kvc.to_jax(x), kvc.to_jax(weight)), x.dtype)


@hookimpl
def pagedllm_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    cos_sin_cache: torch.Tensor) -> tuple:
    q, k = _jit("rotary")(kvc.to_jax(positions.to(torch.int32)), kvc.to_jax(query), kvc.to_jax(key),
                          kvc.to_jax(cos_sin_cache))
    return kvc.to_torch(q, query.dtype), kvc.to_torch(k, key.dtype)


@hookimpl
def pagedllm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return kvc.to_torch(_jit("silu_and_mul")(kvc.to_jax(x)), x.dtype)


_programs: dict = {}


def _jit(name: str, *static: Any) -> Any:
    """The jitted JAX function behind a bridged hook (one per name and static arguments)."""
    fn = _programs.get((name, static))
    if fn is None:
        import jax

        from pagedllm_tpu import attention, model

        if name == "write_kv":
            fn = jax.jit(kvc.write_kv)
        elif name == "attention":
            scale, window, cap = static
            fn = jax.jit(lambda q, pages, lens, idx, cu: attention.ragged_paged_attention(
                q, pages, lens, idx, cu, sm_scale=scale, sliding_window=window, soft_cap=cap))
        elif name == "rms_norm":
            fn = jax.jit(lambda x, w: model.rms_norm(x, w, static[0]))
        elif name == "rotary":
            fn = jax.jit(model.rotary)
        else:
            fn = jax.jit(model.silu_and_mul)
        _programs[(name, static)] = fn
    return fn
