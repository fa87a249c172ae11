"""pagedllm backend for AMD GPUs (distribution ``pagedllm-rocm``); the hooks live in :mod:`pagedllm_rocm.plugin`."""
