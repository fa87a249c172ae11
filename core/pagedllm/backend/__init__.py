"""The public backend API: everything a backend plugin (in this repository or a vendor's package) may import.

A plugin imports ``pagedllm.backend`` and its submodules, nothing else of pagedllm (``tests/core/test_layout.py``
enforces it for the in-repo plugins). Names here follow the contract's version (:data:`API_VERSION`): within a version
they only gain arguments or fields with defaults; a name that moves keeps its old path for one version, with a
``DeprecationWarning`` naming the new one (``pagedllm.deprecated``).

The contract (``hookspec``): ``hookimpl``, ``API_VERSION``, ``ENTRY_POINT_GROUP``, ``BackendSpec`` and the records
hooks take and return — ``BackendInfo``, ``ProbeResult``, ``Capabilities``, ``MemoryInfo``, ``KVCacheSpec``,
``MambaSpec`` (v3: the recurrent-state group), v4's KV cache groups — ``KVCacheConfig``, ``KVCacheGroupSpec``,
``KVCacheTensor``, ``AttentionSpec``, ``FullAttentionSpec``, ``SlidingWindowSpec``, ``MLAAttentionSpec`` — ``ModelInfo``, ``RunnerContext``, ``GraphRunner``, ``QuantizedWeight``,
``QuantizedLinearKernel``.

What hooks receive or may build on:

- ``AttentionMetadata`` — the explicit per-step metadata every attention hook and graph runner reads.
- ``BatchPolicy``, ``BucketPolicy``, ``BatchShape``, ``capped_pow2_buckets`` — batch shapes for static-shape devices
  (``pow2_buckets``: its deprecated name).
- ``make_static_runner``, ``StaticGraphRunner`` — one captured callable per bucket, for ``pagedllm_graph_runner``.
- ``make_graph_runner``, ``DecodeGraphRunner``, ``graphs_disabled``, ``HostValuesUnavailable`` — device-graph
  capture of decode batches for devices whose torch device module has a graph class (``graph_runner.graph_class``).
- ``SamplingTensors``, ``on_device_eligible`` — sampling inside a captured region (``Capabilities.on_device_sampling``).
- ``ParamError``, ``UserError``, ``BackendError`` — errors a hook raises to refuse a setting (named field) or set-up.
- ``Communicator``, ``TorchCommunicator``, ``CollectiveError`` — for ``pagedllm_communicator``.
- ``get_method``, ``dequantize``, ``quantize_per_token`` — the meaning of a ``QuantizedWeight`` (kernels repack it).
- ``add_lora_reference``, ``LoRAMapping`` — multi-LoRA's reference op and its token-to-slot mapping.
- ``cache_root`` — pagedllm's cache folder (compiled kernels may be kept there); ``build_lock``, ``wait_requested``
  (``builds``) — a plugin that compiles ops on the machine builds under the machine-wide lock, and before the engine
  starts when asked (benchmarks ask).
- ``plain_decoder_layers`` (and its records ``PlainLayer``, ``PlainLinear``, ``PlainLinearPart``) — a plain
  Llama-family decoder's layers, for a graph runner that runs whole layers itself (the CPU backend's one-call decode).
- For a backend that owns the whole step (``pagedllm_model_runner``): ``ModelRunner``, ``StepOutput``,
  ``prompt_logit_spans``, ``SamplerOutput``, ``ScheduledRequest``, ``dummy_metadata``.

Submodules: ``hookspec`` (the contract, one documented file), ``registry`` (discovery and the bound ``Backend``),
``builds`` (the build lock), ``reference`` and ``ref_ops`` (core's pure-torch reference ops: every optional hook's
fallback and the conformance oracle; ``conv_ops``, ``ssm_ops`` and ``delta_rule_ops`` for the state hooks: causal
conv1d, Mamba2, Gated DeltaNet), ``kv_quant`` (fp8 KV semantics), ``accelerator`` (the device-generic GPU runtime
hooks and probe steps:
``DeviceHooks``, ``probe_device``), ``triton`` (portable Triton kernels and their op hooks).
"""

from __future__ import annotations

import importlib

from pagedllm.backend.hookspec import (API_VERSION, ENTRY_POINT_GROUP, AttentionSpec, BackendInfo, BackendSpec,
                                       Capabilities, FullAttentionSpec, GraphRunner, KVCacheConfig, KVCacheGroupSpec,
                                       KVCacheSpec, KVCacheTensor, MambaSpec, MemoryInfo, MLAAttentionSpec, ModelInfo,
                                       ProbeResult, QuantizedLinearKernel, QuantizedWeight, RunnerContext,
                                       SlidingWindowSpec, hookimpl)
from pagedllm.errors import ParamError, UserError

# Loaded on first use (PEP 562): they import torch or engine modules, and a plugin module is imported at discovery.
_LAZY = {
    "AttentionMetadata": "pagedllm.backend.attention",
    "BatchPolicy": "pagedllm.backend.batch_policy",
    "BucketPolicy": "pagedllm.backend.batch_policy",
    "BatchShape": "pagedllm.backend.batch_policy",
    "capped_pow2_buckets": "pagedllm.backend.batch_policy",
    "pow2_buckets": "pagedllm.backend.batch_policy",
    "make_static_runner": "pagedllm.backend.static_runner",
    "StaticGraphRunner": "pagedllm.backend.static_runner",
    "make_graph_runner": "pagedllm.backend.graph_runner",
    "DecodeGraphRunner": "pagedllm.backend.graph_runner",
    "graphs_disabled": "pagedllm.backend.graph_runner",
    "HostValuesUnavailable": "pagedllm.backend.graph_runner",
    "SamplingTensors": "pagedllm.backend.device_sampler",
    "on_device_eligible": "pagedllm.backend.device_sampler",
    "BackendError": "pagedllm.backend.registry",
    "Communicator": "pagedllm.distributed.communicator",
    "TorchCommunicator": "pagedllm.distributed.communicator",
    "CollectiveError": "pagedllm.distributed.communicator",
    "get_method": "pagedllm.quantization",
    "dequantize": "pagedllm.quantization",
    "quantize_per_token": "pagedllm.quantization.int8",
    "LoRAMapping": "pagedllm.lora.ops",
    "cache_root": "pagedllm.backend.builds",
    "build_lock": "pagedllm.backend.builds",
    "wait_requested": "pagedllm.backend.builds",
    "plain_decoder_layers": "pagedllm.models.plain_decoder",
    "PlainLayer": "pagedllm.models.plain_decoder",
    "PlainLinear": "pagedllm.models.plain_decoder",
    "PlainLinearPart": "pagedllm.models.plain_decoder",
    "ModelRunner": "pagedllm.worker.model_runner",
    "StepOutput": "pagedllm.worker.model_runner",
    "prompt_logit_spans": "pagedllm.worker.model_runner",
    "SamplerOutput": "pagedllm.sample.sampler",
    "ScheduledRequest": "pagedllm.sched.scheduler",
    "dummy_metadata": "pagedllm.worker.worker",
}
_RENAMED = {"add_lora_reference": ("pagedllm.lora.ops", "add_lora")}

__all__ = ["API_VERSION", "ENTRY_POINT_GROUP", "AttentionSpec", "BackendInfo", "BackendSpec", "Capabilities",
           "FullAttentionSpec", "GraphRunner", "KVCacheConfig", "KVCacheGroupSpec", "KVCacheSpec", "KVCacheTensor",
           "MambaSpec", "MemoryInfo", "MLAAttentionSpec", "ModelInfo", "ProbeResult", "QuantizedLinearKernel",
           "QuantizedWeight", "RunnerContext", "SlidingWindowSpec", "hookimpl", "ParamError", "UserError", *_LAZY,
           *_RENAMED]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _RENAMED:
        module, attr = _RENAMED[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'pagedllm.backend' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
