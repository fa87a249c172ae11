"""LFM2 natively (``Lfm2ForCausalLM``, Liquid AI): gated short-convolution layers interleaved with GQA attention.

A conv layer (transformers' ``Lfm2ShortConv``) projects ``x`` to ``B, C, x'``, convolves ``B * x'`` causally and
depthwise over ``conv_L_cache`` tokens, and gates the result with ``C``: its only state is the last ``L - 1`` inputs
of the convolution, kept per request in a state slot (contract v3: ``hookspec.MambaSpec``,
``AttentionMetadata.state_indices``) and run through the backend's ``causal_conv1d_fn`` (prefill chunks, continuing
from the slot when ``has_initial_state``) and ``causal_conv1d_update`` (decode tokens). Attention layers are Llama's
with a per-head RMSNorm on q and k (``q_layernorm`` / ``k_layernorm``) and ``out_proj``; every layer is pre-norm
(``operator_norm``, ``ffn_norm``) with a SwiGLU ``feed_forward`` (``w1``, ``w3``, ``w2``), and the final norm is
``embedding_norm``. Parameter names are the checkpoint's (q/k/v fused into ``qkv_proj`` as the native decoder does).

Without state slots in the metadata (profiling and warm-up forwards) every conv starts from zeros and keeps nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.causal_lm import RMSNorm
from pagedllm.models.stateful_lm import StateConv1d, StatefulCausalLM, layer_state


def lfm2_intermediate_size(config: Any) -> int:
    """The feed-forward width exactly as transformers' ``Lfm2MLP`` derives it."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            size = config.block_multiple_of * ((size + config.block_multiple_of - 1) // config.block_multiple_of)
    return size


def check_lfm2(config: Any) -> None:
    """Refuse, naming the field, what this module would run differently from transformers' LFM2."""
    kinds = set(config.layer_types) - {"conv", "full_attention"}
    if kinds:
        raise UnsupportedModelError(f"Lfm2ForCausalLM layer_types {sorted(kinds)}: only 'conv' and "
                                    "'full_attention' layers are known")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError(f"Lfm2ForCausalLM num_key_value_heads {config.num_key_value_heads} does not "
                                    f"divide num_attention_heads {config.num_attention_heads}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"Lfm2ForCausalLM rope_type {rope.get('rope_type')!r}: only the default rotary "
                                    "is implemented for LFM2")


class Lfm2ShortConv(nn.Module):
    """``out_proj(C * conv(B * x))`` with ``B, C, x = in_proj(h)``; the conv state lives in the request's slot."""

    def __init__(self, config: Any, backend: Any):
        super().__init__()
        h = config.hidden_size
        self.in_proj = nn.Linear(h, 3 * h, bias=config.conv_bias)
        self.out_proj = nn.Linear(h, h, bias=config.conv_bias)
        self.conv = StateConv1d(h, config.conv_L_cache, config.conv_bias, backend, None)

    def forward(self, x: torch.Tensor, state: Optional[tuple], meta: AttentionMetadata) -> torch.Tensor:
        b, c, xx = self.in_proj(x).chunk(3, dim=-1)
        state = layer_state(state, meta)
        return self.out_proj(c * self.conv(b * xx, None if state is None else state[0], meta))


class Lfm2Attention(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=False)
        self.out_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_layernorm = RMSNorm(self.head_size, config.norm_eps, backend.rms_norm)
        self.k_layernorm = RMSNorm(self.head_size, config.norm_eps, backend.rms_norm)
        self.scale = self.head_size ** -0.5
        self.rotary, self.write_kv, self.paged_attention = backend.rotary, backend.write_kv, backend.paged_attention
        self.k_scale, self.v_scale = 1.0, 1.0  # fp8 KV cache scales (pagedllm.backend.kv_quant)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = self.q_layernorm(q.view(t, self.num_heads, self.head_size))
        k = self.k_layernorm(k.view(t, self.num_kv_heads, self.head_size))
        q, k = self.rotary(positions, q, k, cos_sin_cache)
        self.write_kv(k, v.view(t, self.num_kv_heads, self.head_size), kv_cache, meta.slot_mapping, self.k_scale,
                      self.v_scale)
        out = self.paged_attention(q, kv_cache, meta, self.scale, None, None, self.k_scale, self.v_scale)
        return self.out_proj(out.reshape(t, self.num_heads * self.head_size))


class Lfm2MLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        inter = lfm2_intermediate_size(config)
        self.w1 = nn.Linear(config.hidden_size, inter, bias=False)
        self.w3 = nn.Linear(config.hidden_size, inter, bias=False)
        self.w2 = nn.Linear(inter, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: Any, kind: str):
        super().__init__()
        self.is_attention = kind == "full_attention"
        if self.is_attention:
            self.self_attn = Lfm2Attention(config, backend)
        else:
            self.conv = Lfm2ShortConv(config, backend)
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps, backend.rms_norm)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps, backend.rms_norm)
        self.feed_forward = Lfm2MLP(config)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        x = self.operator_norm(h)
        if self.is_attention:
            h = h + self.self_attn(x, positions, cache, meta, cos_sin_cache)
        else:
            h = h + self.conv(x, cache, meta)
        return h + self.feed_forward(self.ffn_norm(h))


class Lfm2CausalLM(StatefulCausalLM):
    """LFM2 behind pagedllm's model interface (models/stateful_lm.py): the attention layers' paged caches, the conv
    layers' state tensors."""

    def __init__(self, config: Any, spec: Any, backend: Any):
        check_lfm2(config)
        kinds = list(config.layer_types)
        super().__init__(config, spec, num_layers=kinds.count("full_attention"), num_state_layers=kinds.count("conv"),
                         state_shapes=((config.hidden_size, config.conv_L_cache - 1),), tie_word_embeddings=True)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(config, backend, k) for k in kinds)
        self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps, backend.rms_norm)
        self.requires_grad_(False)

    @property
    def state_dtypes(self) -> tuple:
        """The conv state is kept in the model's dtype (HF's cache holds the conv input in it)."""
        return (self.dtype,)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.embedding_norm(h)
