"""PEFT adapters for tests: written by peft itself (``get_peft_model(..., init_lora_weights=False)``), and peft
models as the oracle."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

# name -> LoraConfig kwargs: different ranks, alphas and targets; one rslora; one on every projection.
ADAPTERS: dict[str, dict] = {
    "qv8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
    "rs16": dict(r=16, lora_alpha=32, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"]),
    "ku2": dict(r=2, lora_alpha=4, target_modules=["k_proj", "up_proj"]),
    "attn8": dict(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
}


def base_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def write_adapter(base_path: str, out_dir: str | Path, seed: int = 0, **lora_kwargs) -> str:
    """Save a random (``init_lora_weights=False``) PEFT adapter for the model at ``base_path``."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(base_model(base_path), LoraConfig(init_lora_weights=False, lora_dropout=0.0,
                                                             **lora_kwargs))
    model.save_pretrained(str(out_dir))
    return str(out_dir)


@functools.lru_cache(maxsize=None)
def peft_model(base_path: str, adapter_dir: str):
    from peft import PeftModel

    return PeftModel.from_pretrained(base_model(base_path), adapter_dir).eval()
