"""The HF config and tokenizer of a GGUF file, without parsing its metadata more than once per file.

transformers derives a GGUF's config by parsing every metadata field with ``gguf.GGUFReader`` (~3 s for SmolLM2:
its 49k-token vocabulary and merges are parsed element by element), and ``AutoTokenizer`` derives the config again
before it builds the tokenizer. Here the tokenizer class is resolved from the config we already have, and the
derived ``config.json`` is kept per file (path, size, modification time, transformers version) under the user's
cache directory, so a later start reads it in milliseconds instead of parsing the GGUF again.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pagedllm.models.gguf_archs import OWN_CONFIG_ARCHS, gguf_architecture
from pagedllm.backend.builds import cache_root

logger = logging.getLogger(__name__)


def _cache_dir(path: str) -> Path:
    import transformers  # heavy: transformers

    st = os.stat(path)
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}"
    return cache_root() / "gguf-config" / hashlib.sha256(key.encode()).hexdigest()[:24]


def load_gguf_config(path: str) -> Any:
    """transformers' config for the GGUF file at ``path``, from the per-file cache when it is there."""
    from transformers import AutoConfig  # heavy: transformers

    cached = _cache_dir(path)
    if (cached / "config.json").is_file():
        return AutoConfig.from_pretrained(cached)
    config = AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tmp = None
    try:  # best effort: a read-only home only costs the next start the parse again
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cached.parent)
        config.save_pretrained(tmp)
        os.replace(tmp, cached)  # atomic; fails harmlessly when a concurrent start got there first
    except OSError as e:
        logger.debug("GGUF config cache not written (%s)", e)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return config


def load_gguf_tokenizer(path: str, config: Any) -> Any:
    """The tokenizer ``AutoTokenizer`` would build for this GGUF, without re-deriving its config first. Files of
    ``OWN_CONFIG_ARCHS`` (no transformers config) go through transformers' GGUF tokenizer conversion as well."""
    from transformers import TokenizersBackend  # heavy: transformers
    from transformers.models.auto.tokenization_auto import (TOKENIZER_MAPPING_NAMES,  # heavy: transformers
                                                            tokenizer_class_from_name)


    name = TOKENIZER_MAPPING_NAMES.get(getattr(config, "model_type", None))
    cls = (tokenizer_class_from_name(name) if isinstance(name, str) else None) or TokenizersBackend
    if gguf_architecture(path) in OWN_CONFIG_ARCHS:  # the file's tokenizer model ("gpt2" BPE, "llama" SPM) decides,
        cls = TokenizersBackend  # not the model type's class: transformers' GGUF conversion builds the backend
    return cls.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
