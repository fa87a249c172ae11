"""Native model implementations and model/tokenizer loading (HF folders and GGUF files, no remote code)."""

from pagedllm.models.arch import ARCHITECTURES, architecture_of
from pagedllm.models.causal_lm import CausalLM
from pagedllm.models.loader import load_config, load_model
from pagedllm.models.paths import DEFAULT_GGUF_NAME, default_model_path, resolve_model_path
from pagedllm.models.tokenizer import load_tokenizer

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "DEFAULT_GGUF_NAME",
    "architecture_of",
    "default_model_path",
    "load_config",
    "load_model",
    "load_tokenizer",
    "resolve_model_path",
]
