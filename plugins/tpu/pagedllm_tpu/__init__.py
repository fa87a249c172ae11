"""pagedllm-tpu: a TPU backend for pagedllm on JAX (entry point ``tpu``; hooks in :mod:`pagedllm_tpu.plugin`).

Importing the package imports no JAX: the probe and the runner do, lazily.
"""

__version__ = "0.2.0"
