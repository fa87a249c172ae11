"""Granite-4.0-H natively (``GraniteMoeHybridForCausalLM``, IBM): Mamba2 layers interleaved with GQA attention
layers, each followed by a top-k MoE plus an always-on shared MLP.

Chosen as the Mamba2-hybrid family (issue 28) because transformers 5.25 ships it with a pure-torch path that runs a
tiny random config on the CPU (the oracle), it reuses the Mamba2 mixer unchanged (``models/mamba2.py``: the same
state slots, conv and SSD hooks), and it is the hybrid family with released small checkpoints in wide use.

Granite's multipliers, every one applied: ``embedding_multiplier`` scales the embeddings, ``residual_multiplier``
each sub-block's output before its residual add, ``attention_multiplier`` is the attention's softmax scale (in place
of ``head_dim ** -0.5``), and the logits are divided by ``logits_scaling``. Attention layers use rotary only when
``position_embedding_type == "rope"`` (Granite-4.0-H's own configs use none: "NoPE"). The router takes the top-k
logits and softmaxes over them; experts run through the backend's ``fused_moe`` (the checkpoint's stacked
``input_linear`` ``[E, 2I, H]`` is gate rows then up rows, as ``w13``). Parameter names are the checkpoint's under
``model.`` (q/k/v fused into ``qkv_proj`` as the native decoder does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.causal_lm import RMSNorm
from pagedllm.models.mamba2 import Mamba2Dims, Mamba2Mixer, step_limit
from pagedllm.models.stateful_lm import StatefulCausalLM

ARCH = "GraniteMoeHybridForCausalLM"
LAYER_KINDS = ("linear_attention", "full_attention")  # transformers' names ("mamba" / "attention" in old configs)


def granite_mamba_dims(config: Any) -> Mamba2Dims:
    """``GraniteMoeHybridConfig``'s ``mamba_*`` fields."""
    return Mamba2Dims(config.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                      config.mamba_d_state, config.mamba_d_conv, config.mamba_chunk_size,
                      int(config.mamba_expand * config.hidden_size), bool(config.mamba_proj_bias),
                      bool(config.mamba_conv_bias), config.rms_norm_eps, step_limit(config.time_step_limit))


def uses_rope(config: Any) -> bool:
    return getattr(config, "position_embedding_type", None) == "rope"


def check_granite_hybrid(config: Any) -> None:
    """Refuse, naming the field, what this module would run differently from transformers."""
    kinds = set(config.layer_types) - set(LAYER_KINDS)
    if kinds:
        raise UnsupportedModelError(f"{ARCH} layer_types {sorted(kinds)}: only {list(LAYER_KINDS)} are known")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError(f"{ARCH} num_key_value_heads {config.num_key_value_heads} does not divide "
                                    f"num_attention_heads {config.num_attention_heads}")
    rope = getattr(config, "rope_parameters", None) or {}
    if uses_rope(config) and rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{ARCH} rope_type {rope.get('rope_type')!r}: only the default rotary is "
                                    "implemented for Granite-4.0-H")
    pet = getattr(config, "position_embedding_type", None)
    if pet not in (None, "rope", "nope"):
        raise UnsupportedModelError(f"{ARCH} position_embedding_type {pet!r}: only None and 'rope' are known")
    granite_mamba_dims(config).check(ARCH, config.hidden_act)


class GraniteAttention(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        self.split_sizes = [q_size, kv_size, kv_size]
        bias = bool(config.attention_bias)
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=bias)
        self.scale = float(config.attention_multiplier)  # Granite: the softmax scale itself
        self.rope = uses_rope(config)
        self.rotary, self.write_kv, self.paged_attention = backend.rotary, backend.write_kv, backend.paged_attention
        self.k_scale, self.v_scale = 1.0, 1.0  # fp8 KV cache scales (pagedllm.backend.kv_quant)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q, k = q.reshape(t, self.num_heads, self.head_size), k.reshape(t, self.num_kv_heads, self.head_size)
        if self.rope:
            q, k = self.rotary(positions, q, k, cos_sin_cache)
        self.write_kv(k, v.reshape(t, self.num_kv_heads, self.head_size), kv_cache, meta.slot_mapping, self.k_scale,
                      self.v_scale)
        out = self.paged_attention(q, kv_cache, meta, self.scale, None, None, self.k_scale, self.v_scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_size))


class GraniteSharedMLP(nn.Module):
    """``output_linear(silu(g) * u)`` with ``g, u = input_linear(x).chunk(2)``."""

    def __init__(self, hidden: int, inter: int, backend: Any):
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * inter, bias=False)
        self.output_linear = nn.Linear(inter, hidden, bias=False)
        self.silu_and_mul = backend.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.output_linear(self.silu_and_mul(self.input_linear(x)))


class GraniteRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int):
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False)


class GraniteMoE(nn.Module):
    """Top-k over the router logits, softmax over those k (float32); the experts through ``fused_moe``."""

    def __init__(self, config: Any, backend: Any):
        super().__init__()
        e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.top_k = config.num_experts_per_tok
        self.router = GraniteRouter(h, e)
        self.input_linear = nn.Module()
        self.input_linear.weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.output_linear = nn.Module()
        self.output_linear.weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.fused_moe = backend.fused_moe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits, ids = self.router.layer(x).float().topk(self.top_k, dim=-1)
        weights = torch.softmax(logits, dim=-1)
        return self.fused_moe(x, self.input_linear.weight, self.output_linear.weight, weights, ids)


class GraniteHybridLayer(nn.Module):
    def __init__(self, config: Any, backend: Any, kind: str):
        super().__init__()
        self.is_attention = kind == "full_attention"
        if self.is_attention:
            self.self_attn = GraniteAttention(config, backend)
        else:
            self.mamba = Mamba2Mixer(granite_mamba_dims(config), backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm)
        self.block_sparse_moe = GraniteMoE(config, backend) if config.num_local_experts > 0 else None
        self.shared_mlp = GraniteSharedMLP(config.hidden_size, config.shared_intermediate_size, backend)
        self.residual_multiplier = float(config.residual_multiplier)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        x = (self.self_attn(x, positions, cache, meta, cos_sin_cache) if self.is_attention
             else self.mamba(x, cache, meta))
        h = h + x * self.residual_multiplier
        x = self.post_attention_layernorm(h)
        out = self.shared_mlp(x)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(x) + out
        return h + out * self.residual_multiplier


class GraniteMoeHybridCausalLM(StatefulCausalLM):
    """Granite-4.0-H behind pagedllm's model interface (models/stateful_lm.py): the attention layers' paged caches,
    the Mamba2 layers' ``(conv_states, ssm_states)``."""

    def __init__(self, config: Any, spec: Any, backend: Any):
        check_granite_hybrid(config)
        kinds = list(config.layer_types)
        super().__init__(config, spec, num_layers=kinds.count("full_attention"),
                         num_state_layers=kinds.count("linear_attention"),
                         state_shapes=granite_mamba_dims(config).state_shapes)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        self.layers = nn.ModuleList(GraniteHybridLayer(config, backend, k) for k in kinds)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm)
        self.requires_grad_(False)

    @property
    def state_dtypes(self) -> tuple:
        """Both Mamba2 states in the model's dtype (vLLM's default ``mamba_ssm_cache_dtype``)."""
        return self.dtype, self.dtype

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.logits_scaling
