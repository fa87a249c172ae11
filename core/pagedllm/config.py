"""Engine settings, with vLLM's names; validated at construction so a bad value names its field.

A field a backend may adjust (``BACKEND_SETTABLE``) is ``None`` (``dtype``: ``"auto"``) until the user sets it, so
``pagedllm_update_config`` tells a user's choice from a default; :func:`resolve_config` fills the defaults after
that hook (``DEFAULT_MAX_NUM_SEQS``...), so the values an engine runs with are the ones the CLI and ``LLM()``
document."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from pagedllm.backend.kv_quant import KV_CACHE_DTYPES, canonical_kv_dtype
from pagedllm.backend.state_capability import check_state_support
from pagedllm.quantization.config import resolve_quantization, validate_quantization
from pagedllm.errors import ParamError
from pagedllm.generation_defaults import check_generation_config
from pagedllm.kv_transfer.config import DEFAULT_DISK_GIB, KVTransferConfig, offload_config
from pagedllm.multimodal.content_parts import parse_limit_mm_per_prompt
from pagedllm.pooling.config import PoolerConfig
from pagedllm.pooling.spec import CONVERTS, RUNNERS, runner_type
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.structured_output.limits import StructuredOutputsConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: Optional[str] = None  # HF folder, .gguf file or Hub id org/name; None = the embedded default model
    device: str = "auto"
    dtype: str = "auto"  # auto: float32 on backends without fast half precision, else the checkpoint's
    max_model_len: Optional[int] = None
    block_size: Optional[int] = None  # None: the backend's preferred size (config hook, else its first)
    enable_prefix_caching: bool = True
    max_num_seqs: Optional[int] = None  # None: DEFAULT_MAX_NUM_SEQS, after the backend's update_config
    max_num_batched_tokens: Optional[int] = None  # default: the backend's, else max(2048, max_model_len) <= 8192
    # vision-language models: encoder output tokens (image placeholders) one step may encode, and the encoder
    # cache's size; default max_num_batched_tokens, at least one image (docs/multimodal.md)
    max_num_encoder_input_tokens: Optional[int] = None
    kv_cache_memory: Optional[int] = None  # bytes for the KV pool
    gpu_memory_utilization: Optional[float] = None  # fraction of free device memory for the KV pool
    num_gpu_blocks_override: Optional[int] = None  # exact pool size (tests)
    swap_space: float = 0.0  # GiB of host memory for swapped-out KV blocks
    # vLLM's name: one block table for every layer, so sliding-window layers keep every block (sched/kv_groups.py)
    disable_hybrid_kv_cache_manager: bool = False
    scheduling_policy: str = "fcfs"  # fcfs | priority
    seed: int = 0
    skip_tokenizer_init: bool = False
    enforce_eager: Optional[bool] = None  # None: False (graphs on), after the backend's update_config
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | fp8 (= fp8_e4m3) | fp8_e4m3 | fp8_e5m2 (pagedllm.backend.kv_quant)
    structured_outputs_backend: str = "auto"  # auto | xgrammar | guidance (structured_output/manager.py)
    # grammar limits and compile pool (dict / JSON / StructuredOutputsConfig; docs/structured_outputs.md)
    structured_outputs_config: Any = None
    enable_lora: bool = False  # serve LoRA adapters (docs/lora.md)
    max_loras: int = 1  # adapters one step may use (device slots)
    max_lora_rank: int = 16  # largest adapter rank; slots are padded to it
    max_cpu_loras: Optional[int] = None  # host copies kept (LRU); default max_loras
    model_impl: str = "auto"  # auto | native | transformers (the transformers fallback: docs/models.md)
    # vLLM method name, or none (dense). None: the checkpoint's own when the backend runs it and no dtype was given
    # (pagedllm.quantization.resolve_quantization; docs/quantization.md)
    quantization: Optional[str] = None
    speculative_config: Any = None  # dict / JSON / SpeculativeConfig (docs/spec_decode.md); None: off
    # Distributed inference inside one engine (docs/distributed.md); vLLM's names.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: Optional[str] = None  # mp (default when more than one rank) | ray
    enable_expert_parallel: bool = False
    distributed_timeout_s: float = 300.0  # the longest any collective waits for a peer before the engine fails
    # This engine's number among data-parallel replicas on its host (the DP server sets it per replica): its ranks
    # use device indices [data_parallel_rank * tp * pp, ...) on backends whose devices are indexed (not CPU).
    data_parallel_rank: int = 0
    # Default sampling parameters: auto (the model's generation_config.json) | vllm (ignore it) | a folder holding
    # one (vLLM's --generation-config; generation_defaults.py)
    generation_config: str = "auto"
    # Pooling (docs/pooling.md), vLLM's names: runner auto | generate | pooling (auto: pooling for a pooling
    # architecture or a convert), convert auto | none | embed | classify | reward, pooler_config (dict / JSON /
    # PoolerConfig), hf_overrides (dict merged into the HF config, e.g. a Qwen3-Reranker's classifier_from_token)
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: Any = None
    hf_overrides: Optional[dict] = None
    # KV beyond the device pool (docs/kv-offload.md): a connector in vLLM's shape (dict / JSON / KVTransferConfig),
    # or the built-in prefix-cache tiers: GiB of host memory, a folder for the disk tier and its bound in GiB
    kv_transfer_config: Any = None
    kv_offload_gib: float = 0.0
    kv_offload_dir: Optional[str] = None
    kv_offload_disk_gib: float = DEFAULT_DISK_GIB
    # vLLM's limit_mm_per_prompt: most items per prompt of each modality ({"image": 4}; a dict or its JSON; a
    # modality left out allows multimodal.content_parts.DEFAULT_LIMIT_PER_PROMPT)
    limit_mm_per_prompt: Optional[dict] = None
    # vLLM's media sources of image URLs (multimodal/media.py): file: URLs only under this folder (None: refused),
    # http(s) URLs only from these hosts (None or empty: any)
    allowed_local_media_path: Optional[str] = None
    allowed_media_domains: Optional[list[str]] = None

    def __post_init__(self) -> None:
        if self.runner not in RUNNERS:
            raise ParamError("runner", f"must be one of {', '.join(RUNNERS)}, got {self.runner!r}")
        if self.convert not in CONVERTS:
            raise ParamError("convert", f"must be one of {', '.join(CONVERTS)}, got {self.convert!r}")
        if self.runner == "generate" and self.convert not in ("auto", "none"):
            raise ParamError("convert", f"{self.convert!r} turns the model into a pooling model; it needs "
                                        "runner 'pooling' (or 'auto'), not 'generate'")
        self.pooler_config = PoolerConfig.parse(self.pooler_config)
        self.limit_mm_per_prompt = parse_limit_mm_per_prompt(self.limit_mm_per_prompt)
        if self.allowed_local_media_path is not None and not isinstance(self.allowed_local_media_path, str):
            raise ParamError("allowed_local_media_path", "must be a folder path (a string)")
        if self.allowed_media_domains is not None and (
                isinstance(self.allowed_media_domains, str)
                or not all(isinstance(d, str) for d in self.allowed_media_domains)):
            raise ParamError("allowed_media_domains", "must be a list of host names")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ParamError("hf_overrides", f"must be a dict (JSON object), got {type(self.hf_overrides).__name__}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.structured_outputs_config = StructuredOutputsConfig.parse(self.structured_outputs_config)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ParamError("dtype", f"must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1
                                            or self.block_size & (self.block_size - 1)):
            raise ParamError("block_size", f"must be a power of two, got {self.block_size!r}")
        if self.max_num_seqs is not None and (not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1):
            raise ParamError("max_num_seqs", f"must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ParamError("max_model_len", f"must be an integer >= 2, got {self.max_model_len!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ParamError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.max_num_encoder_input_tokens is not None and (not isinstance(self.max_num_encoder_input_tokens, int)
                                                              or self.max_num_encoder_input_tokens < 1):
            raise ParamError("max_num_encoder_input_tokens", f"must be an integer >= 1, got "
                                                             f"{self.max_num_encoder_input_tokens!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ParamError("kv_cache_memory", f"must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ParamError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not isinstance(self.data_parallel_rank, int) or self.data_parallel_rank < 0:
            raise ParamError("data_parallel_rank", f"must be an integer >= 0, got {self.data_parallel_rank!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ParamError("scheduling_policy", f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.structured_outputs_backend not in ("auto", "xgrammar", "guidance"):
            raise ParamError("structured_outputs_backend", "must be 'auto', 'xgrammar' or 'guidance', got "
                                                           f"{self.structured_outputs_backend!r}")
        if self.model_impl not in ("auto", "native", "transformers"):
            raise ParamError("model_impl", f"must be 'auto', 'native' or 'transformers', got {self.model_impl!r}")
        validate_quantization(self.quantization)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        for name in ("kv_offload_gib", "kv_offload_disk_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ParamError(name, f"must be a number of GiB >= 0, got {v!r}")
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, (str, os.PathLike))
                                                or not str(self.kv_offload_dir)):
            raise ParamError("kv_offload_dir", f"must be a folder path, got {self.kv_offload_dir!r}")
        if self.kv_offload_gib > 0 or self.kv_offload_dir:
            offload = offload_config(self.kv_offload_gib, self.kv_offload_dir, self.kv_offload_disk_gib)
            if self.kv_transfer_config not in (None, offload):
                raise ParamError("kv_offload_gib", "kv_offload_gib / kv_offload_dir choose the OffloadingConnector; "
                                                   "give them or kv_transfer_config, not both")
            self.kv_transfer_config = offload
        check_generation_config(self.generation_config)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParamError(name, f"must be an integer >= 1, got {v!r}")
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ParamError("distributed_executor_backend", f"must be 'mp' or 'ray', got "
                                                             f"{self.distributed_executor_backend!r}")
        if not self.distributed_timeout_s > 0:
            raise ParamError("distributed_timeout_s", f"must be > 0 seconds, got {self.distributed_timeout_s!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ParamError("kv_cache_dtype", f"must be one of {', '.join(KV_CACHE_DTYPES)}; got "
                                               f"{self.kv_cache_dtype!r}")
        if self.swap_space < 0:
            raise ParamError("swap_space", f"must be >= 0 GiB, got {self.swap_space!r}")
        if not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ParamError("max_loras", f"must be an integer >= 1, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or self.max_lora_rank < 1:
            raise ParamError("max_lora_rank", f"must be an integer >= 1, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ParamError("max_cpu_loras", f"must be an integer >= max_loras ({self.max_loras}), "
                                              f"got {self.max_cpu_loras!r}")


#: Fields a backend's ``pagedllm_update_config`` may set; each is ``None`` (dtype ``"auto"``) when the user left it.
BACKEND_SETTABLE = ("block_size", "dtype", "max_num_batched_tokens", "max_num_seqs", "enforce_eager")
#: ``max_num_seqs`` when neither the user nor the backend sets it (vLLM's default).
DEFAULT_MAX_NUM_SEQS = 256


def dtype_name(dtype: str) -> str:
    """Canonical name of a dtype alias (``bf16`` -> ``bfloat16``)."""
    return str(DTYPES[dtype]).removeprefix("torch.")


def resolve_config(config: EngineConfig, backend: Any, info: Any) -> EngineConfig:
    """The config an engine runs with: the backend's ``pagedllm_update_config`` changes first, then what is still
    unset from the checkpoint and the backend's capabilities; every capability checked here, before any weight is
    read, with a :class:`ParamError` naming the field. Returns a new config with dtype, block_size, max_model_len,
    max_num_seqs, max_num_batched_tokens and enforce_eager filled in."""
    user_dtype = config.dtype
    config = replace(config, runner=runner_type(config.runner, config.convert, info.architecture))
    changes = backend.update_config(config, info) or {}
    refused = sorted(set(changes) - set(BACKEND_SETTABLE))
    if refused:
        raise ParamError(refused[0], f"backend {backend.name!r} may only set {', '.join(BACKEND_SETTABLE)} "
                                     f"from pagedllm_update_config, not {', '.join(refused)}")
    config = replace(config, **changes)  # __post_init__ validates the backend's values too
    caps, name = backend.capabilities, backend.name
    supported = {dtype_name(d) for d in caps.dtypes}
    if config.dtype == "auto":
        config.dtype = info.dtype if info.dtype in supported else dtype_name(caps.dtypes[0])
    if dtype_name(config.dtype) not in supported:
        raise ParamError("dtype", f"backend {name!r} supports {caps.dtypes}, not {config.dtype!r}")
    config.dtype = dtype_name(config.dtype)
    config.quantization = resolve_quantization(config.quantization, user_dtype, info.quantization, backend,
                                               config.dtype)
    if config.block_size is None:
        config.block_size = caps.block_sizes[0]
    if config.block_size not in caps.block_sizes:
        raise ParamError("block_size", f"backend {name!r} supports {caps.block_sizes}, not {config.block_size}")
    if canonical_kv_dtype(config.kv_cache_dtype) not in caps.kv_cache_dtypes:
        raise ParamError("kv_cache_dtype", f"backend {name!r} supports {', '.join(caps.kv_cache_dtypes)}, "
                                           f"not {config.kv_cache_dtype!r}")
    if caps.head_sizes is not None and info.head_size not in caps.head_sizes:
        raise ParamError("model", f"head size {info.head_size} is not supported by backend {name!r} "
                                  f"(supports {caps.head_sizes})")
    if info.sliding_window is not None and not caps.sliding_window:
        raise ParamError("model", f"{info.architecture} uses sliding-window attention ({info.sliding_window}), "
                                  f"which backend {name!r} does not support")
    if info.mla and not caps.mla:
        raise ParamError("model", f"{info.architecture} uses multi-head latent attention (a latent KV cache), which "
                                  f"backend {name!r} does not support")
    if info.soft_cap is not None and not caps.soft_cap:
        raise ParamError("model", f"{info.architecture} uses attention logit soft-capping ({info.soft_cap}), "
                                  f"which backend {name!r} does not support")
    if info.alibi and not caps.alibi:
        raise ParamError("model", f"{info.architecture} uses ALiBi attention (position bias instead of rotary), "
                                  f"which backend {name!r} does not support (Capabilities.alibi)")
    if info.attention_sinks and not caps.attention_sinks:
        raise ParamError("model", f"{info.architecture} uses attention sinks (a learned logit in every softmax), "
                                  f"which backend {name!r} does not support (Capabilities.attention_sinks)")
    if info.mm_prefix_lm and not caps.mm_prefix_lm:
        raise ParamError("model", f"{info.architecture} attends bidirectionally within each image (PrefixLM image "
                                  f"spans), which backend {name!r} does not support (Capabilities.mm_prefix_lm)")
    check_state_support(info, caps, name, config.dtype)  # a hybrid / SSM model's state ops and dtypes
    if config.enable_lora and caps.graph_capture != "none" and not config.enforce_eager:
        # The per-step LoRA mapping is host-built Python state that captured graphs cannot replay.
        logger.warning("--enable-lora: backend %r captures graphs (%s); LoRA runs eager, so enforce_eager is set",
                       name, caps.graph_capture)
        config.enforce_eager = True
    if config.speculative_config is not None and caps.graph_capture != "none" and not config.enforce_eager:
        # Verification steps have per-request query lengths 1 + k that captured decode graphs do not cover.
        logger.warning("speculative_config: backend %r captures graphs (%s); speculation runs eager, so "
                       "enforce_eager is set", name, caps.graph_capture)
        config.enforce_eager = True
    if config.runner == "pooling":
        check_pooling(config)
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        check_distributed(config, backend, info)
    if config.max_model_len is None:
        config.max_model_len = info.max_model_len
    elif config.max_model_len > info.max_model_len:
        raise ParamError("max_model_len", f"{config.max_model_len} exceeds the model's "
                                          f"max_position_embeddings {info.max_model_len}")
    if config.max_num_batched_tokens is None:
        config.max_num_batched_tokens = min(max(2048, config.max_model_len), 8192)
    if config.max_num_seqs is None:
        config.max_num_seqs = DEFAULT_MAX_NUM_SEQS
    config.enforce_eager = bool(config.enforce_eager)
    return config


def check_pooling(config: EngineConfig) -> None:
    """What the pooling runner does not combine with yet is refused by name (it runs one rank, no drafts)."""
    for name, on in (("speculative_config", config.speculative_config is not None),
                     ("tensor_parallel_size", config.tensor_parallel_size > 1),
                     ("pipeline_parallel_size", config.pipeline_parallel_size > 1)):
        if on:
            raise ParamError(name, "is not supported with the pooling runner (runner='pooling') yet")


def check_distributed(config: EngineConfig, backend: Any, info: Any) -> None:
    """What a multi-rank engine does not run yet is refused by name; graph capture is turned off (the step crosses
    processes through collectives that captured graphs do not replay)."""
    for name, on in (("enable_lora", config.enable_lora), ("speculative_config", config.speculative_config),
                     ("swap_space", config.swap_space > 0), ("quantization", config.quantization),
                     ("kv_transfer_config", config.kv_transfer_config)):
        if on:
            raise ParamError(name, "is not supported with tensor_parallel_size / pipeline_parallel_size > 1 yet")
    if config.model_impl == "transformers":
        raise ParamError("model_impl", "tensor/pipeline parallel runs native models only")
    if not config.enforce_eager:
        logger.info("tensor/pipeline parallel: eager mode (enforce_eager set)")
        config.enforce_eager = True
