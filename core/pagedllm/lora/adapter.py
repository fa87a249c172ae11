"""Load a PEFT LoRA folder into per-layer, per-projection (A, scaled B) host tensors, refusing what we cannot run.

Supported: ``adapter_config.json`` with ``peft_type`` LORA, targets among q/k/v/o and gate/up/down projections,
``bias: none``, any ``r`` up to ``max_lora_rank``, ``lora_alpha / r`` scaling or ``lora_alpha / sqrt(r)`` with
``use_rslora``. Refused with an error naming the feature: DoRA, embedding/lm_head or other targets, trained biases,
``modules_to_save``, per-module rank/alpha patterns.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load_file

from pagedllm.errors import ParamError

#: Projection -> (site, sub-projection index). Sites are the model's fused linears.
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0),
}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoRAError(ParamError):
    """An adapter cannot be loaded or does not fit this engine/model; the message names the problem."""


@dataclass
class LoRAModel:
    """One adapter on the host: ``weights[(layer, projection)] = (A [r, in], B*scaling [out, r])``."""

    lora_int_id: int
    name: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _targets(cfg: dict) -> list[str]:
    t = cfg.get("target_modules")
    if t == "all-linear":
        return list(TARGETS)
    if isinstance(t, str):  # a regex over full module names
        try:
            return [m for m in TARGETS if re.search(t, f"model.layers.0.self_attn.{m}") or
                    re.search(t, f"model.layers.0.mlp.{m}")] or [t]
        except re.error as e:
            raise LoRAError("target_modules", f"target_modules is not a valid regex: {e}") from None
    if t is not None and (not isinstance(t, list) or not all(isinstance(m, str) for m in t)):
        raise LoRAError("target_modules", f"target_modules must be a list of names or a regex, got {t!r}")
    return [m.rsplit(".", 1)[-1] for m in (t or [])]


def read_config(path: str, max_lora_rank: int) -> dict:
    """``adapter_config.json`` checked against what pagedllm runs; raises :class:`LoRAError` naming the problem."""
    if not os.path.isdir(path):
        raise LoRAError("lora_path", f"LoRA adapter folder {path!r} does not exist")
    cfg_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_file):
        raise LoRAError("lora_path", f"{path!r} has no adapter_config.json (not a PEFT adapter folder)")
    try:
        with open(cfg_file, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError, RecursionError) as e:  # unreadable, not UTF-8, not JSON, nested past the limit
        raise LoRAError("lora_path", f"{cfg_file!r} is not a readable JSON file: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError("lora_path", f"{cfg_file!r} must hold a JSON object, got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError("lora_path", f"{path!r}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    bad = [m for m in _targets(cfg) if m not in TARGETS]
    if bad:
        raise LoRAError("target_modules", f"adapter {path!r} targets unsupported module(s) {bad}; supported: "
                                          f"{sorted(TARGETS)}")
    for key, what in (("use_dora", "DoRA (use_dora)"), ("modules_to_save", "modules_to_save"),
                      ("rank_pattern", "per-module ranks (rank_pattern)"),
                      ("alpha_pattern", "per-module alphas (alpha_pattern)"),
                      ("trainable_token_indices", "trainable_token_indices")):
        if cfg.get(key):
            raise LoRAError(key, f"adapter {path!r} uses {what}, which pagedllm does not support")
    if cfg.get("bias", "none") != "none":
        raise LoRAError("bias", f"adapter {path!r} trains biases (bias={cfg['bias']!r}); only 'none' is supported")
    r = cfg.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAError("r", f"adapter {path!r} has invalid rank r={r!r}")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise LoRAError("lora_alpha", f"adapter {path!r} has invalid lora_alpha={alpha!r}")
    if r > max_lora_rank:
        raise LoRAError("max_lora_rank", f"adapter {path!r} has rank {r} > max_lora_rank {max_lora_rank}; "
                                         f"raise --max-lora-rank")
    return cfg


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    pt = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            return load_file(st)
        if os.path.isfile(pt):
            out = torch.load(pt, map_location="cpu", weights_only=True)
            if not isinstance(out, dict) or not all(isinstance(t, torch.Tensor) for t in out.values()):
                raise LoRAError("lora_path", f"{pt!r} does not hold a dict of tensors")
            return out
    except LoRAError:
        raise
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file: safetensors/pickle errors of every kind
        raise LoRAError("lora_path", f"{path!r}: the adapter weights cannot be read ({type(e).__name__}: {e})") from None
    raise LoRAError("lora_path", f"{path!r} has no adapter_model.safetensors (or adapter_model.bin)")


def load_adapter(lora_int_id: int, name: str, path: str, max_lora_rank: int, model: Any) -> LoRAModel:
    """Read and check one adapter against ``model`` (a :class:`~pagedllm.models.causal_lm.CausalLM`): layer
    count and every tensor's shape. B is pre-multiplied by the scaling and everything is cast to the model dtype."""
    cfg = read_config(path, max_lora_rank)
    r = cfg["r"]
    alpha = cfg.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in _read_tensors(path).items():
        m = _KEY.search(key)
        if m is None:
            raise LoRAError("target_modules", f"adapter {path!r} has tensor {key!r}, which pagedllm does not support "
                                              f"(only lora_A/lora_B of {sorted(TARGETS)} in decoder layers)")
        layer, proj, ab = int(m.group(1)), m.group(2), m.group(3)
        if proj not in TARGETS:
            raise LoRAError("target_modules", f"adapter {path!r} targets unsupported module {proj!r} ({key})")
        if layer >= model.num_layers:
            raise LoRAError("lora_path", f"adapter {path!r} has layer {layer}; the model has {model.num_layers}")
        pairs.setdefault((layer, proj), {})[ab] = t
    out = LoRAModel(lora_int_id, name, r, scaling)
    for (layer, proj), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise LoRAError("lora_path", f"adapter {path!r}: layer {layer} {proj} lacks lora_{'AB'[('A' in ab)]}")
        a, b = ab["A"], ab["B"]
        site, sub = TARGETS[proj]
        in_dim, out_dim = site_io(model, layer, site, sub)
        if a.shape != (r, in_dim) or b.shape != (out_dim, r):
            raise LoRAError("lora_path", f"adapter {path!r}: layer {layer} {proj} has A {tuple(a.shape)}, "
                                         f"B {tuple(b.shape)}; this model needs A ({r}, {in_dim}), B ({out_dim}, {r})")
        out.weights[(layer, proj)] = (a.to(model.dtype).contiguous(),
                                      (b.float() * scaling).to(model.dtype).contiguous())
    return out


def site_io(model: Any, layer: int, site: str, sub: int) -> tuple[int, int]:
    """(in features, out features) of one sub-projection of a fused site."""
    return model.lora_site_split(layer, site)[0], model.lora_site_split(layer, site)[1][sub]
