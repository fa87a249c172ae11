"""Tokenizer loading through HF transformers (fast tokenizers), for folders and GGUF files alike."""

from __future__ import annotations

import os
from typing import Any, Optional

from pagedllm.models.paths import is_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")


def load_tokenizer(model_path: str) -> Optional[Any]:
    """A HF tokenizer for ``model_path``, or ``None`` when a folder ships none (tiny random test models)."""
    from transformers import AutoTokenizer

    if is_gguf(model_path):
        return AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path))
    if not any(os.path.isfile(os.path.join(model_path, f)) for f in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)
