"""``cpu-static``: the CPU backend run as a static-shape device (entry point ``cpu-static``).

Same kernels, allocator and memory as ``cpu``; what changes is the engine's shape discipline, exactly as a TPU, Gaudi
or Ascend backend would set it: every step padded to power-of-two buckets (capped at the budgets) of tokens,
sequences and block-table width (``BucketPolicy``), padding written to a sink block, every bucket warmed up before
serving, the forward, logits and sampling replayed per bucket from persistent buffers (``StaticGraphRunner``, eager
capture). Models with recurrent state run too: their slot indices ride in the bucket buffers, padding rows as
slot -1 (``pagedllm.backend.static_runner``). It exists so the static path of core and the conformance suite run
for real on any machine; it is slower than ``cpu`` by the padding (docs/benchmarks.md) and is not meant for serving.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagedllm.backend.batch_policy import BucketPolicy, capped_pow2_buckets
from pagedllm.backend.hookspec import BackendInfo, Capabilities, GraphRunner, RunnerContext, hookimpl
from pagedllm.backend.static_runner import make_static_runner
from pagedllm_cpu import plugin as _cpu
from pagedllm_cpu.plugin import (pagedllm_allocate_kv_cache, pagedllm_apply_token_bitmask,  # noqa: F401
                                 pagedllm_communicator, pagedllm_distributed_backend, pagedllm_encoder_attention,
                                 pagedllm_fused_add_rms_norm,
                                 pagedllm_memory_info, pagedllm_paged_attention, pagedllm_probe, pagedllm_rms_norm,
                                 pagedllm_quantized_linear, pagedllm_rotary, pagedllm_set_device,
                                 pagedllm_silu_and_mul, pagedllm_update_config, pagedllm_write_kv)
from pagedllm_cpu.plugin import (pagedllm_chunk_gated_delta_rule,  # noqa: F401  (recurrent-state ops)
                                 pagedllm_fused_recurrent_gated_delta_rule, pagedllm_mamba_chunk_scan_combined,
                                 pagedllm_selective_state_update)

#: The smallest token bucket: decode batches of a few sequences share one shape.
MIN_TOKEN_BUCKET = 8


@hookimpl
def pagedllm_backend_info() -> BackendInfo:
    return BackendInfo(name="cpu-static", device_type="cpu", priority=0, extra="cpu",
                       description="host CPU in static-shape mode (buckets, warm-up, on-device sampling): "
                                   "exercises the TPU/HPU-style path on any machine")


@hookimpl
def pagedllm_capabilities() -> Capabilities:
    return replace(_cpu.pagedllm_capabilities(), graph_capture="full", on_device_sampling=True)


@hookimpl
def pagedllm_batch_policy(ctx: RunnerContext) -> BucketPolicy:
    """Powers of two up to the engine's budgets (vllm-gaudi's exponential bucketing)."""
    return BucketPolicy(token_buckets=capped_pow2_buckets(ctx.max_num_batched_tokens, MIN_TOKEN_BUCKET),
                        seq_buckets=capped_pow2_buckets(ctx.max_num_seqs),
                        block_buckets=capped_pow2_buckets(-(-ctx.max_model_len // ctx.block_size)),
                        block_size=ctx.block_size)


@hookimpl
def pagedllm_graph_runner(model: Any, max_num_seqs: int, device: torch.device, ctx: RunnerContext) -> GraphRunner:
    return make_static_runner(model, ctx)
