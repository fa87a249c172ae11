"""Multi-LoRA serving: PEFT adapters applied per token in a mixed batch (punica-style shrink/expand)."""

from pagedllm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
