"""Tokenizer loading through HF transformers (fast tokenizers), for folders and GGUF files alike."""

from __future__ import annotations

import os
from typing import Any, Optional

from pagedllm.models.gguf_config import load_gguf_tokenizer
from pagedllm.models.paths import is_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(model_path: str, config: Any = None) -> Optional[Any]:
    """A HF tokenizer for ``model_path``, or ``None`` when a folder ships none (tiny random test models).
    ``config``: the model's HF config if already read (saves a GGUF file a second metadata parse)."""
    from transformers import AutoTokenizer  # heavy: transformers

    if is_gguf(model_path):
        if config is not None:
            return load_gguf_tokenizer(model_path, config)
        return AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    if not any(os.path.isfile(os.path.join(model_path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
