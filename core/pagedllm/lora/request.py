"""``LoRARequest``: which adapter a request runs with (vLLM's name and fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.errors import ParamError


@dataclass(frozen=True)
class LoRARequest:
    """An adapter folder (PEFT ``adapter_config.json`` + ``adapter_model.safetensors``) under a name and an integer
    id. The id keys the adapter everywhere in the engine (slots, prefix cache); it must be >= 1 (0 is the base)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ParamError("lora_request.lora_name", f"must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ParamError("lora_request.lora_int_id", f"must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ParamError("lora_request.lora_path", f"must name an adapter folder, got {self.lora_path!r}")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
