"""A plain decoder's layers as records, for a graph runner that runs whole decoder layers itself (the CPU backend's
one-call decode): core says which of its models are plain Llama-family decoders and hands out each layer's tensors
and linear kernels, so a backend reads no model class of core's (public as ``pagedllm.backend.plain_decoder_layers``).

Plain: core's ``CausalLM`` whose every layer is RMSNorm -> attention (fused q/k/v, rotary, paged KV) -> residual
add fused with RMSNorm -> SiLU-gated MLP -> residual add, without q/k norms, interleaved rotary, ALiBi, attention sinks,
soft-capping, Gemma's offset norms or extra norms, per-layer rotary tables, a scaled embedding, MoE, MLA, or a
pipeline stage; every linear a ``QuantizedLinear`` (one kernel) or its mixed-type split (parts joined). A layer runs
as: ``x = rms_norm(h, input_norm)``; ``q, k, v = qkv(x).view(T, -1, head_size).split(heads)``; rotary on q and k;
write k, v; attention; ``a = o(out)``; ``x = fused_add_rms_norm(a, h, post_attention_norm)`` (``a += h``);
``h = down(silu_and_mul(gate_up(x))) + a``. A graph runner that computes the same may take such a model's steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedllm.models.causal_lm import Attention, CausalLM, DecoderLayer, GatedMLP, RMSNorm, gelu_tanh_and_mul
from pagedllm.quantization.linear import QuantizedLinear, SplitQuantizedLinear


@dataclass(frozen=True)
class PlainLinearPart:
    """One kernel call: ``kernel`` is the ``QuantizedLinearKernel.name`` that prepared ``state``; ``y += bias``."""

    kernel: str
    state: Any
    bias: Optional[torch.Tensor]


@dataclass(frozen=True)
class PlainLinear:
    """A layer's linear: one part, or parts whose outputs are joined (``joined``), then ``bias`` added."""

    parts: tuple[PlainLinearPart, ...]
    joined: bool
    bias: Optional[torch.Tensor]


@dataclass(frozen=True)
class PlainLayer:
    """One decoder layer: its two norms, attention shape, and four linears (module docstring: how it runs)."""

    input_norm: torch.Tensor
    input_eps: float
    post_attention_norm: torch.Tensor
    post_attention_eps: float
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    sliding_window: Optional[int]
    qkv: PlainLinear
    o: PlainLinear
    gate_up: PlainLinear
    down: PlainLinear


def _linear(lin: Any) -> Optional[PlainLinear]:
    joined = type(lin) is SplitQuantizedLinear
    parts = list(lin.parts) if joined else [lin]
    if any(type(p) is not QuantizedLinear for p in parts):
        return None
    return PlainLinear(tuple(PlainLinearPart(p.kernel_name, p.state, p.bias) for p in parts), joined,
                       lin.bias if joined else None)


def plain_decoder_layers(model: Any) -> tuple[Optional[list[PlainLayer]], str]:
    """(``model``'s layers as records, "") where it is a plain decoder (module docstring), else (None, why not)."""
    if type(model) is not CausalLM:
        return None, f"{type(model).__name__} is not core's plain decoder"
    if model.rope_caches or model.embed_scale is not None or (model.start_layer, model.end_layer) != (
            0, model.num_layers):
        return None, "per-layer rotary tables, a scaled embedding or a pipeline stage"
    layers = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if (type(layer) is not DecoderLayer or type(attn) is not Attention or type(mlp) is not GatedMLP
                or layer.pre_feedforward_layernorm is not None or layer.post_self_attn_layernorm is not None):
            return None, "a layer other than a plain Llama layer"
        if (attn.q_norm is not None or attn.rope_interleaved_dim or attn.alibi or attn.sinks is not None
                or attn.soft_cap is not None or mlp.silu_and_mul is gelu_tanh_and_mul):
            return None, "q/k norms, interleaved rotary, ALiBi, sinks, soft-capping or GeGLU"
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        if type(n1) is not RMSNorm or type(n2) is not RMSNorm or n1.offset or n2.offset or n2.fused_add_op is None:
            return None, "offset norms, or no fused add + RMSNorm"
        linears = [_linear(x) for x in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(x is None for x in linears):
            return None, "a linear other than a QuantizedLinear (dense, tensor-parallel or LoRA-wrapped)"
        layers.append(PlainLayer(n1.weight, n1.eps, n2.weight, n2.eps, attn.num_heads, attn.num_kv_heads,
                                 attn.head_size, attn.scale, attn.sliding_window, *linears))
    return layers, ""
