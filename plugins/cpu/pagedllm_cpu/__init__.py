"""pagedllm's CPU backend, packaged as any third-party backend is: a pluggy plugin under ``pagedllm.backend.registry``."""

__version__ = "0.2.0"
