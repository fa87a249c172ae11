"""Remote-code checkpoints recognised from ``config.json`` and loaded by name mapping; their code never runs.

Baichuan-7B / Baichuan2-7B are Llama with q/k/v fused in ``self_attn.W_pack`` (rows q, k, v: exactly our fused
``qkv_proj``); Baichuan2 (vocab 125696) normalises ``lm_head`` rows at inference (NormHead), applied once at load as
vLLM does. The 13B variants (Baichuan-13B, Baichuan2-13B: ``BaichuanForCausalLM`` at a hidden size other than 4096,
vLLM's rule) are the same layout without rotary, attending with ALiBi (unscaled slopes added after the
``1/sqrt(head_size)`` scaling, as their remote code does): ``config.pagedllm_alibi``.

ChatGLM2 / ChatGLM3 / GLM-4 (remote code, ``model_type`` ``chatglm``) are transformers' ``Glm``: q/k/v fused in
``query_key_value`` (rows q, k, v: our ``qkv_proj``), ``dense_h_to_4h`` = gate then up (our ``gate_up_proj``),
rotary over half the head in interleaved pairs with base ``10000 * rope_ratio``, RMSNorm. ChatGLM-6B (v1: 2D
positions, GeLU, post-layernorm residuals) is refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch

from pagedllm.errors import UnsupportedModelError

_BAICHUAN2_VOCAB = 125696

#: Remote-code architectures mapped onto a native decoder: name -> what runs (for ``pagedllm models``).
REMOTE_LAYOUTS: dict[str, str] = {
    "ChatGLMModel": "ChatGLM2/3, GLM-4 (remote code): Glm with query_key_value / dense_h_to_4h mapped by name; "
                    "ChatGLM-6B v1 refused",
    "BaiChuanForCausalLM": "Baichuan-7B: Llama with W_pack split",
    "BaichuanForCausalLM": "Baichuan2-7B (hidden 4096): Llama with W_pack split, NormHead; 13B: the same with ALiBi "
                           "instead of rotary",
}


def chatglm_config(raw: dict) -> Any:
    """ChatGLM2/3 (GLM-4) ``config.json`` -> the equivalent transformers ``GlmConfig``; v1 and variants we do not
    map are refused naming what differs."""
    archs = ", ".join(raw.get("architectures") or []) or "ChatGLMModel"
    if "padded_vocab_size" not in raw or "kv_channels" not in raw:
        raise UnsupportedModelError(f"{archs} without padded_vocab_size/kv_channels is ChatGLM-6B (v1: 2D "
                                    "positions, GeLU), which pagedllm does not implement; ChatGLM2/3 and GLM-4 "
                                    "checkpoints load as Glm")
    unsupported = {k: raw.get(k) for k, ok in (("rmsnorm", True), ("add_bias_linear", False),
                                                ("apply_residual_connection_post_layernorm", False),
                                                ("post_layer_norm", True), ("original_rope", True))
                   if raw.get(k, ok) != ok}
    if unsupported:
        raise UnsupportedModelError(f"{archs} with {unsupported} is a ChatGLM variant pagedllm does not map "
                                    "onto Glm")
    from transformers import GlmConfig  # heavy: transformers

    heads = raw["num_attention_heads"]
    config = GlmConfig(
        vocab_size=raw["padded_vocab_size"], hidden_size=raw["hidden_size"], intermediate_size=raw["ffn_hidden_size"],
        num_hidden_layers=raw["num_layers"], num_attention_heads=heads, head_dim=raw["kv_channels"],
        num_key_value_heads=raw["multi_query_group_num"] if raw.get("multi_query_attention") else heads,
        partial_rotary_factor=0.5, rope_theta=10000.0 * raw.get("rope_ratio", 1), hidden_act="silu",
        rms_norm_eps=raw.get("layernorm_epsilon", 1e-5), attention_bias=bool(raw.get("add_qkv_bias", False)),
        max_position_embeddings=raw.get("seq_length", 2048), bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"), pad_token_id=raw.get("pad_token_id"), tie_word_embeddings=False,
        architectures=["GlmForCausalLM"])
    config.pagedllm_layout = "chatglm"
    config.pagedllm_source_architecture = (raw.get("architectures") or ["ChatGLMModel"])[0]
    if raw.get("torch_dtype"):
        config.dtype = raw["torch_dtype"]
    return config


def remote_code_config(raw: dict) -> Optional[Any]:
    """A transformers config equivalent to a remote-code ``config.json`` we can map, else None."""
    archs = raw.get("architectures") or []
    if raw.get("model_type") == "chatglm" or any(a.startswith("ChatGLM") for a in archs):
        return chatglm_config(raw)
    if raw.get("model_type") != "baichuan" and not any(a in ("BaichuanForCausalLM", "BaiChuanForCausalLM")
                                                       for a in archs):
        return None
    # vLLM's rule: BaiChuanForCausalLM is Baichuan-7B (rotary); BaichuanForCausalLM is rotary at hidden 4096
    # (Baichuan2-7B) and ALiBi otherwise (Baichuan-13B, Baichuan2-13B).
    alibi = "BaiChuanForCausalLM" not in archs and raw.get("hidden_size") != 4096
    from transformers import LlamaConfig  # heavy: transformers

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
    config.pagedllm_alibi = alibi
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


_CHATGLM_NAMES = [  # our Glm name (HF's, fused) -> the ChatGLM checkpoint's
    (r"model\.embed_tokens\.weight", "transformer.embedding.word_embeddings.weight"),
    (r"model\.norm\.weight", "transformer.encoder.final_layernorm.weight"),
    (r"lm_head\.weight", "transformer.output_layer.weight"),
    (r"model\.layers\.(\d+)\.(input_layernorm|post_attention_layernorm)\.weight",
     r"transformer.encoder.layers.\1.\2.weight"),
    (r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.(weight|bias)",
     r"transformer.encoder.layers.\1.self_attention.query_key_value.\2"),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"transformer.encoder.layers.\1.self_attention.dense.weight"),
    (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", r"transformer.encoder.layers.\1.mlp.dense_h_to_4h.weight"),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"transformer.encoder.layers.\1.mlp.dense_4h_to_h.weight"),
]
# Checkpoint tensors derived from the config, recomputed rather than read (ChatGLM saves its rotary inv_freq).
_CHATGLM_DERIVED = {"transformer.rotary_pos_emb.inv_freq"}


class ChatGLMWeights:
    """A weight source under Glm names over a ChatGLM2/3 checkpoint; records what was taken, like
    :class:`BaichuanWeights`."""

    def __init__(self, source: Any, config: Any):
        self.source = source
        self.taken: set[str] = {n for n in _CHATGLM_DERIVED if n in source}

    @staticmethod
    def name(ours: str) -> Optional[str]:
        """The ChatGLM checkpoint name of a Glm tensor name, or None (q_proj... exist only fused)."""
        for pattern, repl in _CHATGLM_NAMES:
            if re.fullmatch(pattern, ours):
                return re.sub(pattern, repl, ours)
        return None

    def __contains__(self, name: str) -> bool:
        real = self.name(name)
        return real is not None and real in self.source

    def take(self, name: str) -> torch.Tensor:
        real = self.name(name)
        self.taken.add(real)
        return self.source.take(real)


def wrap_weights(source: Any, config: Any) -> Any:
    """The weight source the native loader reads for ``config`` (a name-mapping view for remote-code layouts)."""
    layout = getattr(config, "pagedllm_layout", None)
    if layout == "baichuan":
        return BaichuanWeights(source, config)
    if layout == "chatglm":
        return ChatGLMWeights(source, config)
    return source


def check_covered(weights: Any, all_names: set[str]) -> None:
    """Remote-code layouts: every checkpoint tensor must have been mapped (a tensor left over means a layout
    variant this mapping does not know, whose outputs would be silently wrong)."""
    what = {BaichuanWeights: ("Baichuan->Llama", "Baichuan"), ChatGLMWeights: ("ChatGLM->Glm", "ChatGLM")}
    if type(weights) in what:
        left = sorted(all_names - weights.taken)
        if left:
            mapping, family = what[type(weights)]
            raise UnsupportedModelError(f"{len(left)} checkpoint tensors have no place in the {mapping} "
                                        f"mapping (e.g. {left[:3]}); this {family} variant is not supported")
