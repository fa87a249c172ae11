"""Remote-code checkpoints recognised from ``config.json`` and loaded by name mapping; their code never runs.

Baichuan-7B / Baichuan2-7B are Llama with q/k/v fused in ``self_attn.W_pack`` (rows q, k, v: exactly our fused
``qkv_proj``); Baichuan2 (vocab 125696) normalises ``lm_head`` rows at inference (NormHead), applied once at load as
vLLM does. The 13B variants use ALiBi, which pagedllm does not implement, and are refused by name.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from pagedllm.errors import UnsupportedModelError

_BAICHUAN2_VOCAB = 125696

#: Remote-code architectures mapped onto a native decoder: name -> what runs (for ``pagedllm models``).
REMOTE_LAYOUTS: dict[str, str] = {
    "BaiChuanForCausalLM": "Baichuan-7B: Llama with W_pack split",
    "BaichuanForCausalLM": "Baichuan2-7B (hidden 4096): Llama with W_pack split, NormHead; 13B (ALiBi) refused",
}


def remote_code_config(raw: dict) -> Optional[Any]:
    """A transformers config equivalent to a remote-code ``config.json`` we can map, else None."""
    archs = raw.get("architectures") or []
    if raw.get("model_type") != "baichuan" and not any(a in ("BaichuanForCausalLM", "BaiChuanForCausalLM")
                                                       for a in archs):
        return None
    # vLLM's rule: BaiChuanForCausalLM is Baichuan-7B (rotary); BaichuanForCausalLM is rotary at hidden 4096
    # (Baichuan2-7B) and ALiBi otherwise (Baichuan-13B, Baichuan2-13B).
    if "BaiChuanForCausalLM" not in archs and raw.get("hidden_size") != 4096:
        raise UnsupportedModelError(f"{', '.join(archs) or 'baichuan'} with hidden_size {raw.get('hidden_size')} "
                                    "is a 13B Baichuan variant with ALiBi attention, which pagedllm does not "
                                    "implement; Baichuan-7B and Baichuan2-7B load as Llama")
    from transformers import LlamaConfig

    heads = raw["num_attention_heads"]
    config = LlamaConfig(
        vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=heads, num_key_value_heads=heads,
        hidden_act=raw.get("hidden_act", "silu"), rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings") or raw.get("model_max_length") or 4096,
        bos_token_id=raw.get("bos_token_id"), eos_token_id=raw.get("eos_token_id"),
        pad_token_id=raw.get("pad_token_id"), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        architectures=["LlamaForCausalLM"])
    config.pagedllm_layout = "baichuan"
    config.pagedllm_source_architecture = (archs or ["BaichuanForCausalLM"])[0]
    if raw.get("torch_dtype"):
        config.dtype = raw["torch_dtype"]
    return config


class BaichuanWeights:
    """A weight source under Llama names over a Baichuan checkpoint; records what was taken, so the loader can
    refuse a checkpoint holding tensors the mapping does not cover."""

    def __init__(self, source: Any, config: Any):
        self.source = source
        self.normhead = config.vocab_size == _BAICHUAN2_VOCAB
        self.taken: set[str] = set()

    @staticmethod
    def _name(name: str) -> str:
        return name.replace(".self_attn.qkv_proj.", ".self_attn.W_pack.")

    def __contains__(self, name: str) -> bool:
        return self._name(name) in self.source

    def take(self, name: str) -> torch.Tensor:
        real = self._name(name)
        self.taken.add(real)
        t = self.source.take(real)
        if self.normhead and real == "lm_head.weight":
            t = torch.nn.functional.normalize(t.float()).to(t.dtype)
        return t


def wrap_weights(source: Any, config: Any) -> Any:
    """The weight source the native loader reads for ``config`` (a name-mapping view for remote-code layouts)."""
    if getattr(config, "pagedllm_layout", None) == "baichuan":
        return BaichuanWeights(source, config)
    return source


def check_covered(weights: Any, all_names: set[str]) -> None:
    """Remote-code layouts: every checkpoint tensor must have been mapped (a tensor left over means a layout
    variant this mapping does not know, whose outputs would be silently wrong)."""
    if isinstance(weights, BaichuanWeights):
        left = sorted(all_names - weights.taken)
        if left:
            raise UnsupportedModelError(f"{len(left)} checkpoint tensors have no place in the Baichuan->Llama "
                                        f"mapping (e.g. {left[:3]}); this Baichuan variant is not supported")
