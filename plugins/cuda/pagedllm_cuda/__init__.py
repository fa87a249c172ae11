"""pagedllm backend for NVIDIA GPUs (distribution ``pagedllm-cuda``); the hooks live in :mod:`pagedllm_cuda.plugin`."""
