"""Engine settings, with vLLM's names; validated at construction so a bad value names its field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from pagedllm.sampling_params import ParamError

DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


@dataclass
class EngineConfig:
    model: Optional[str] = None  # HF folder or .gguf file; None = the embedded default model
    device: str = "auto"
    dtype: str = "auto"  # auto: float32 on backends without fast half precision, else the checkpoint's
    max_model_len: Optional[int] = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None  # default: max(2048, max_model_len) capped at 8192
    kv_cache_memory: Optional[int] = None  # bytes for the KV pool
    gpu_memory_utilization: Optional[float] = None  # fraction of free device memory for the KV pool
    num_gpu_blocks_override: Optional[int] = None  # exact pool size (tests)
    swap_space: float = 0.0  # GiB of host memory for swapped-out KV blocks
    scheduling_policy: str = "fcfs"  # fcfs | priority
    seed: int = 0
    skip_tokenizer_init: bool = False
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ParamError("dtype", f"must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ParamError("block_size", f"must be a power of two, got {self.block_size!r}")
        if not isinstance(self.max_num_seqs, int) or self.max_num_seqs < 1:
            raise ParamError("max_num_seqs", f"must be an integer >= 1, got {self.max_num_seqs!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ParamError("max_model_len", f"must be an integer >= 2, got {self.max_model_len!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ParamError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ParamError("kv_cache_memory", f"must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ParamError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ParamError("scheduling_policy", f"must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.swap_space < 0:
            raise ParamError("swap_space", f"must be >= 0 GiB, got {self.swap_space!r}")
