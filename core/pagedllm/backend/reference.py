"""Core's fallback implementations of every optional hook, registered ``trylast`` beside each backend."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from pagedllm.backend import conv_ops, ref_ops
from pagedllm.backend.batch_policy import BatchPolicy
from pagedllm.backend.hookspec import (AttentionSpec, Capabilities, GraphRunner, KVCacheConfig, KVCacheSpec,
                                       MambaSpec, MLAAttentionSpec, ModelInfo, RunnerContext, hookimpl)
from pagedllm.lora import ops as lora_ops


@hookimpl(trylast=True)
def pagedllm_capabilities() -> Capabilities:
    """Every optional feature off: the registry adds those of the reference ops the backend leaves to core."""
    return Capabilities()


@hookimpl(trylast=True)
def pagedllm_memory_peak(device: torch.device) -> Optional[int]:
    return None


@hookimpl(trylast=True)
def pagedllm_update_config(config: Any, model_info: ModelInfo) -> Optional[dict]:
    return None


@hookimpl(trylast=True)
def pagedllm_batch_policy(ctx: RunnerContext) -> BatchPolicy:
    return BatchPolicy()


@hookimpl(trylast=True)
def pagedllm_model_runner(ctx: RunnerContext, model: Any, kv: Any) -> Any:
    return None


@hookimpl(trylast=True)
def pagedllm_distributed_backend() -> str:
    return "gloo"


@hookimpl(trylast=True)
def pagedllm_communicator(ranks: list[int], device: torch.device, collective: str, timeout_s: float) -> Any:
    from pagedllm.distributed.communicator import TorchCommunicator  # heavy: torch

    return TorchCommunicator(ranks, device, timeout_s, collective)


@hookimpl(trylast=True)
def pagedllm_set_device(device: torch.device) -> None:
    return None


@hookimpl(trylast=True)
def pagedllm_synchronize(device: torch.device) -> None:
    return None


@hookimpl(trylast=True)
def pagedllm_allocate_kv_cache(spec: KVCacheSpec) -> list:
    return ref_ops.allocate_kv_cache(spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads,
                                     spec.head_size, spec.dtype, spec.device, mla=spec.mla)


@hookimpl(trylast=True)
def pagedllm_allocate_host_kv_cache(spec: KVCacheSpec, pin_memory: bool) -> list:
    caches = pagedllm_allocate_kv_cache(spec)
    return [c.pin_memory() for c in caches] if pin_memory else caches


@hookimpl(trylast=True)
def pagedllm_allocate_state_cache(spec: MambaSpec) -> list:
    return conv_ops.allocate_state_cache(spec)


def kv_cache_groups_from(config: KVCacheConfig, allocate_kv_cache: Callable[[KVCacheSpec], list],
                         allocate_state_cache: Callable[[MambaSpec], list]) -> dict:
    """``pagedllm_allocate_kv_cache_groups`` from the v3 allocators, so a backend without the v4 hook gets exactly
    the caches it got before: one :class:`KVCacheSpec` of ``len(config.kv_cache_tensors)`` layers (every paged group
    has one page shape), tensor i viewed by ``kv_cache_tensors[i].shared_by``, and the state group's
    ``allocate_state_cache`` entries in its layer order."""
    caches: dict = {}
    paged = [g.kv_cache_spec for g in config.kv_cache_groups if isinstance(g.kv_cache_spec, AttentionSpec)]
    if paged:
        page = paged[0]
        pages = {(p.block_size, p.num_kv_heads, p.head_size, p.dtype, p.num_planes) for p in paged}
        if len(pages) > 1:  # core builds one page shape per model; a second would need the v4 hook
            raise ValueError(f"KV cache groups of {len(pages)} page shapes cannot share one KVCacheSpec: {pages}")
        spec = KVCacheSpec(len(config.kv_cache_tensors), config.num_blocks, page.block_size, page.num_kv_heads,
                           page.head_size, page.dtype, config.device, mla=isinstance(page, MLAAttentionSpec))
        for tensor, cache in zip(config.kv_cache_tensors, allocate_kv_cache(spec), strict=True):
            caches.update(dict.fromkeys(tensor.shared_by, cache))
    for group in config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, MambaSpec):
            caches.update(zip(group.layer_ids, allocate_state_cache(group.kv_cache_spec), strict=True))
    return caches


@hookimpl(trylast=True)
def pagedllm_allocate_kv_cache_groups(config: KVCacheConfig) -> dict:
    return kv_cache_groups_from(config, pagedllm_allocate_kv_cache, pagedllm_allocate_state_cache)


@hookimpl(trylast=True)
def pagedllm_causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, state_indices, has_initial_state,
                              activation):
    return conv_ops.causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, state_indices,
                                     has_initial_state, activation)


@hookimpl(trylast=True)
def pagedllm_causal_conv1d_update(x, conv_states, weight, bias, activation, state_indices):
    return conv_ops.causal_conv1d_update(x, conv_states, weight, bias, activation, state_indices)


@hookimpl(trylast=True)
def pagedllm_write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale) -> None:
    ref_ops.write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)


@hookimpl(trylast=True)
def pagedllm_paged_attention(query, kv_cache, meta, scale, sliding_window, soft_cap, k_scale, v_scale,
                             alibi_slopes=None, sinks=None):
    return ref_ops.paged_attention(query, kv_cache, meta, scale, sliding_window, soft_cap, k_scale, v_scale,
                                   alibi_slopes, sinks)


@hookimpl(trylast=True)
def pagedllm_encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal):
    return ref_ops.encoder_attention(query, key, value, cu_seqlens, max_seqlen, scale, causal)


@hookimpl(trylast=True)
def pagedllm_write_mla_kv(latent, kv_cache, slot_mapping) -> None:
    ref_ops.write_mla_kv(latent, kv_cache, slot_mapping)


@hookimpl(trylast=True)
def pagedllm_mla_attention(query, kv_cache, meta, scale, value_size):
    return ref_ops.mla_attention(query, kv_cache, meta, scale, value_size)


@hookimpl(trylast=True)
def pagedllm_gather_kv_blocks(kv_cache, block_ids):
    return ref_ops.gather_kv_blocks(kv_cache, block_ids)


@hookimpl(trylast=True)
def pagedllm_swap_kv_blocks(src_caches, dst_caches, src, dst) -> None:
    ref_ops.swap_kv_blocks(src_caches, dst_caches, src, dst)


@hookimpl(trylast=True)
def pagedllm_graph_runner(model, max_num_seqs, device) -> GraphRunner:
    return GraphRunner(run=model, level="none")


@hookimpl(trylast=True)
def pagedllm_rms_norm(x, weight, eps):
    return ref_ops.rms_norm(x, weight, eps)


@hookimpl(trylast=True)
def pagedllm_fused_add_rms_norm(x, residual, weight, eps):
    return ref_ops.fused_add_rms_norm(x, residual, weight, eps)


@hookimpl(trylast=True)
def pagedllm_rotary(positions, query, key, cos_sin_cache):
    return ref_ops.rotary(positions, query, key, cos_sin_cache)


@hookimpl(trylast=True)
def pagedllm_silu_and_mul(x):
    return ref_ops.silu_and_mul(x)


@hookimpl(trylast=True)
def pagedllm_apply_token_bitmask(logits, bitmask) -> None:
    ref_ops.apply_token_bitmask(logits, bitmask)


@hookimpl(trylast=True)
def pagedllm_add_lora(y, x, lora_a, lora_b, mapping) -> None:
    lora_ops.add_lora(y, x, lora_a, lora_b, mapping)


@hookimpl(trylast=True)
def pagedllm_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids):
    return ref_ops.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids)


@hookimpl(trylast=True)
def pagedllm_quantized_linear(method: str, weight_type: str) -> None:
    return None  # core's reference (pagedllm.quantization) serves every method and weight type


# ---- recurrent-state ops: Mamba2 and Gated DeltaNet ----------------------------------------------------------------
from pagedllm.backend import delta_rule_ops, ssm_ops  # noqa: E402  (kept with the block it serves)


@hookimpl(trylast=True)
def pagedllm_selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices):
    return ssm_ops.selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_indices)


@hookimpl(trylast=True)
def pagedllm_mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states, D, z, dt_bias,
                                       dt_softplus, dt_limit):
    return ssm_ops.mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, cu_seqlens, initial_states, D, z, dt_bias,
                                             dt_softplus, dt_limit)


@hookimpl(trylast=True)
def pagedllm_chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm_in_kernel):
    return delta_rule_ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, cu_seqlens, scale,
                                                 use_qk_l2norm_in_kernel)


@hookimpl(trylast=True)
def pagedllm_fused_recurrent_gated_delta_rule(q, k, v, g, beta, scale, state, state_indices,
                                              use_qk_l2norm_in_kernel):
    return delta_rule_ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta, state, state_indices, scale,
                                                           use_qk_l2norm_in_kernel)
