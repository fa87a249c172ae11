"""What a sentence-transformers folder says about pooling: ``modules.json``, the Pooling module's ``config.json``
(``1_Pooling/config.json``), a ``Normalize`` module, and ``config_sentence_transformers.json`` (prompts)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Optional

from pagedllm.errors import UnsupportedModelError

# sentence-transformers' pooling_mode_* flags -> vLLM's pooling types
_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_POOLING = "sentence_transformers.models.Pooling"
_NORMALIZE = "sentence_transformers.models.Normalize"
_TRANSFORMER = "sentence_transformers.models.Transformer"


@dataclass
class SentenceTransformersConfig:
    pooling_type: Optional[str] = None
    normalize: bool = False
    prompts: dict[str, str] = field(default_factory=dict)


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def read_sentence_transformers_config(model_path: str) -> Optional[SentenceTransformersConfig]:
    """The folder's sentence-transformers pooling, or None when it has no ``modules.json``. Modules pagedllm does
    not run (Dense projections...) are refused by name rather than silently skipped."""
    modules_file = os.path.join(model_path, "modules.json")
    if not os.path.isfile(model_path) and os.path.isfile(modules_file):
        modules = _read_json(modules_file)
    else:
        return None
    out = SentenceTransformersConfig()
    for m in modules:
        kind, sub = m.get("type", ""), m.get("path", "")
        if kind == _POOLING:
            cfg_file = os.path.join(model_path, sub, "config.json")
            cfg = _read_json(cfg_file) if os.path.isfile(cfg_file) else {}
            on = [t for flag, t in _MODES.items() if cfg.get(flag)]
            other = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in _MODES]
            if other or len(on) > 1:
                raise UnsupportedModelError(f"{cfg_file}: pooling modes {', '.join(other or on)} are not supported; "
                                            f"pagedllm pools one of {', '.join(sorted(_MODES))}")
            out.pooling_type = on[0] if on else None
        elif kind == _NORMALIZE:
            out.normalize = True
        elif kind != _TRANSFORMER:
            raise UnsupportedModelError(f"{modules_file}: sentence-transformers module {kind!r} ({sub or '.'}) is "
                                        "not supported (pagedllm runs Transformer, Pooling and Normalize)")
    st_file = os.path.join(model_path, "config_sentence_transformers.json")
    if os.path.isfile(st_file):
        out.prompts = dict(_read_json(st_file).get("prompts") or {})
    return out
