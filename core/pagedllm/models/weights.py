"""Checkpoint readers (safetensors folders, GGUF files) and the HF-name -> fused-parameter mapping."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Optional, Protocol

import torch
from safetensors import safe_open

from pagedllm.errors import ModelNotFoundError
from pagedllm.models.moe import expert_tensor


class WeightSource(Protocol):
    """HF-named checkpoint tensors, read one at a time."""

    def __contains__(self, name: str) -> bool: ...

    def take(self, name: str) -> torch.Tensor:
        """The tensor ``name``; each is taken once, so a source may drop its own reference."""


class SafetensorsWeights:
    """A HF folder's ``*.safetensors`` (single file or sharded via ``model.safetensors.index.json``), mmapped."""

    def __init__(self, folder: str):
        index = os.path.join(folder, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            paths = [os.path.join(folder, name) for name in files]
        else:
            paths = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
        if not paths:
            raise ModelNotFoundError(f"model: {folder} holds no *.safetensors weights (other formats are not loaded)")
        self._files = {p: safe_open(p, framework="pt") for p in paths}
        self._where = {name: h for h in self._files.values() for name in h.keys()}

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> set[str]:
        return set(self._where)

    def take(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name)


class DictWeights(dict):
    """Tensors already in memory."""

    def take(self, name: str) -> torch.Tensor:
        return self.pop(name)  # frees the dequantized copy as soon as its fused/cast copy exists


class RenamedWeights:
    """A checkpoint read under the names the decoder's loader asks for: a subclass's ``_candidates(name)`` lists the
    checkpoint names to try (the first present wins), one subclass per model family whose checkpoints come in
    several layouts (LLaVA, Idefics3, Qwen2-VL, Gemma 3 vision)."""

    def __init__(self, source: Any):
        self.source = source

    def _candidates(self, name: str) -> list[str]:
        raise NotImplementedError

    def _resolve(self, name: str) -> Optional[str]:
        return next((c for c in self._candidates(name) if c in self.source), None)

    def __contains__(self, name: str) -> bool:
        return self._resolve(name) is not None

    def take(self, name: str) -> torch.Tensor:
        real = self._resolve(name)
        if real is None:
            raise KeyError(f"checkpoint lacks tensor {name!r} (looked for {self._candidates(name)})")
        return self.source.take(real)


def fused_state_dict(model: Any, weights: WeightSource, dtype: torch.dtype, device: torch.device,
                     progress: Optional[Callable[[int], Any]] = None) -> dict[str, torch.Tensor]:
    """Our state dict from HF-named tensors: q/k/v and gate/up concatenated along the output dim. ``progress(1)``
    is called as each parameter is read (the loader's progress bar)."""
    # Models named exactly as their checkpoint (Falcon's transformer.h.N...) take no prefix.
    prefix = "" if getattr(model, "checkpoint_names", False) else checkpoint_prefix(weights)
    tick = progress if progress is not None else (lambda _n: None)

    def load(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"checkpoint lacks tensor {name!r}")
        return weights.take(name).to(device=device, dtype=dtype)

    def cat(names: list[str]) -> torch.Tensor:
        return torch.cat([load(n) for n in names], dim=0)

    sd: dict[str, torch.Tensor] = {}
    for key in model.state_dict():
        moe = expert_tensor(key, prefix, weights.__contains__, load)  # MoE: stacked experts (models/moe.py)
        if moe is not None:
            sd[key] = moe
            tick(1)
            continue
        names = source_names(key, prefix)
        # Already fused in the checkpoint (Phi-3 qkv_proj / gate_up_proj) when the parts are not there. The parts
        # win: a GGUF name map resolves several HF names to one tensor (Phi-3's gate_up_proj and Llama's up_proj
        # are both ffn_up).
        if len(names) > 1 and not all(n in weights for n in names) and prefix + key in weights:
            names = [prefix + key]
        sd[key] = load(names[0]) if len(names) == 1 else cat(names)
        tick(1)
    return sd


def source_names(key: str, prefix: str) -> list[str]:
    """The HF checkpoint names whose rows make up our parameter ``key`` (fused q/k/v and gate/up: several)."""
    module, _, leaf = key.rpartition(".")
    if key in ("lm_head.weight", "score.weight"):  # (score: a *ForSequenceClassification head, unprefixed)
        return [key]
    if module.endswith("self_attn.qkv_proj"):
        base = prefix + module.removesuffix("qkv_proj")
        return [f"{base}{p}_proj.{leaf}" for p in "qkv"]
    if module.endswith(".gate_up_proj"):  # mlp.gate_up_proj, and the MoE shared_expert.gate_up_proj
        base = prefix + module.removesuffix("gate_up_proj")
        return [f"{base}gate_proj.{leaf}", f"{base}up_proj.{leaf}"]
    return [prefix + key]


def checkpoint_prefix(weights: WeightSource) -> str:
    return "model." if "model.embed_tokens.weight" in weights else ""

