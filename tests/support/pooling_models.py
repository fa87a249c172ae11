"""Tiny pooling checkpoints (seeded, float32) for the pooling runner's oracles: HF ``*ForSequenceClassification``
models, decoders carrying SmolLM2's real tokenizer (pairs, "yes"/"no" tokens), and sentence-transformers folders
(``modules.json``, ``1_Pooling/config.json``, optional ``Normalize``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from server_utils import tiny_chat_model
from tiny_models import _COMMON, TINY_CONFIGS, _randomize_norms_and_biases

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# sentence-transformers' Pooling config for each pooling type
ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens", "CLS": "pooling_mode_cls_token"}


def _config(arch: str, overrides: dict[str, Any]):
    from transformers import AutoConfig

    kwargs = {**_COMMON, **TINY_CONFIGS[arch], **overrides}
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def _save(model: torch.nn.Module, out_dir: str | os.PathLike, seed: int, tokenizer: bool) -> str:
    _randomize_norms_and_biases(model, torch.Generator().manual_seed(seed + 1))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer:
        copy_tokenizer(out)
    return str(out)


def tokenizer_vocab_size() -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(tiny_chat_model()))


def copy_tokenizer(out_dir: str | os.PathLike) -> None:
    src = tiny_chat_model()
    for f in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), out_dir)


def make_seq_cls_model(arch: str, out_dir: str | os.PathLike, num_labels: int, seed: int = 0,
                       tokenizer: bool = False, **overrides: Any) -> str:
    """A tiny random ``<Arch>ForSequenceClassification`` (``arch``: llama | qwen3) with ``num_labels`` labels."""
    from transformers import AutoModelForSequenceClassification

    if tokenizer:
        overrides = {"vocab_size": tokenizer_vocab_size(), **overrides}
    config = _config(arch, {"num_labels": num_labels, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF inits the head small; widen it so the classes are well separated
        model.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed + 2))
    return _save(model, out_dir, seed, tokenizer)


def make_causal_lm(arch: str, out_dir: str | os.PathLike, seed: int = 0, tokenizer: bool = False,
                   **overrides: Any) -> str:
    """A tiny random ``<Arch>ForCausalLM``, with SmolLM2's tokenizer (and its vocabulary size) if asked."""
    from transformers import AutoModelForCausalLM

    if tokenizer:
        overrides = {"vocab_size": tokenizer_vocab_size(), **overrides}
    config = _config(arch, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return _save(model, out_dir, seed, tokenizer)


def make_st_folder(model_dir: str, out_dir: str | os.PathLike, pooling_type: str, normalize: bool) -> str:
    """A sentence-transformers folder over ``model_dir``'s files: Transformer, Pooling(``pooling_type``), and a
    Normalize module when ``normalize``."""
    out = Path(out_dir)
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (out / "modules.json").write_text(json.dumps(modules))
    if normalize:
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "1_Pooling").mkdir(exist_ok=True)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    pooling = {"word_embedding_dimension": hidden, **{mode: t == pooling_type for t, mode in ST_MODES.items()}}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (out / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))
    return str(out)
