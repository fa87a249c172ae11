"""pagedllm: paged-KV LLM inference with a small, versioned hardware-backend contract.

Names are loaded lazily so ``import pagedllm`` (and the CLI's ``backends`` command) stays fast.
"""

from __future__ import annotations

import importlib

from pagedllm import deprecated as _deprecated

__version__ = "0.2.0"

_EXPORTS = {
    "LLM": "pagedllm.entrypoints.llm",
    "SamplingParams": "pagedllm.sampling_params",
    "StructuredOutputsParams": "pagedllm.sampling_params",
    "BeamSearchParams": "pagedllm.sampling_params",
    "RequestOutput": "pagedllm.outputs",
    "CompletionOutput": "pagedllm.outputs",
    "Logprob": "pagedllm.outputs",
    "PoolingParams": "pagedllm.pooling_params",
    "PoolingOutput": "pagedllm.outputs",
    "PoolingRequestOutput": "pagedllm.outputs",
    "EmbeddingRequestOutput": "pagedllm.outputs",
    "ClassificationRequestOutput": "pagedllm.outputs",
    "ScoringRequestOutput": "pagedllm.outputs",
    "EngineConfig": "pagedllm.config",
    "LLMEngine": "pagedllm.engine.llm_engine",
    "ParamError": "pagedllm.errors",
    "LoRARequest": "pagedllm.lora.request",
    "BeamSearchOutput": "pagedllm.entrypoints.beam_search",
    "BeamSearchSequence": "pagedllm.entrypoints.beam_search",
}

__all__ = list(_EXPORTS)

_deprecated.install()


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
