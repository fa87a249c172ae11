"""Qwen3-Next natively (``Qwen3NextForCausalLM``): Gated DeltaNet linear-attention layers interleaved with gated full
attention (``config.layer_types``, from ``full_attention_interval``), a sparse MoE with a shared expert (dense MLP
layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say), and zero-centred RMSNorms (``1 + weight``).

A linear-attention layer (transformers' ``Qwen3NextGatedDeltaNet``) projects ``h`` to ``q, k, v, z``
(``in_proj_qkvz``, grouped per key head as in the checkpoint) and ``b, a`` (``in_proj_ba``), convolves ``cat(q, k, v)``
causally and depthwise (``linear_conv_kernel_dim`` taps, silu), runs the gated delta rule over the convolved q / k
(L2-normalised) and v with ``beta = sigmoid(b)`` and log decay ``g = -exp(A_log) * softplus(a + dt_bias)``, then a
gated RMSNorm per value head (``norm(o) * silu(z)``) and ``out_proj``. Its state per request is two tensors in one
state slot (contract v3: ``hookspec.MambaSpec``): the conv state (the last ``kernel - 1`` inputs, ``[conv_dim,
kernel - 1]``, model dtype) and the delta-rule state (``[HV, K, V]``, float32 as HF keeps it). Prefill chunks go
through the backend's ``causal_conv1d_fn`` and ``chunk_gated_delta_rule`` (continuing from the slot when
``has_initial_state``), decode tokens through ``causal_conv1d_update`` and ``fused_recurrent_gated_delta_rule``.

A full-attention layer is Qwen3's with an output gate (``q_proj`` yields a query and a gate per head; the output is
``o * sigmoid(gate)``), per-head q/k norms and a partial rotary (``partial_rotary_factor``, 0.25), over the paged
KV cache. The layout follows ``models/lfm2.py``; without state slots in the metadata (profiling and warm-up forwards)
every linear-attention layer starts from zeros and keeps nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import ArchSpec
from pagedllm.models.causal_lm import GatedMLP, RMSNorm
from pagedllm.models.moe import SparseMoeBlock, is_moe_layer
from pagedllm.models.stateful_lm import StateConv1d, StatefulCausalLM, layer_state

LAYER_KINDS = ("linear_attention", "full_attention")


def is_qwen3_5(config: Any) -> bool:
    """Qwen3.5 text (``Qwen3_5ForCausalLM``, ``Qwen3_5MoeForCausalLM``): Qwen3-Next's layers with the linear
    attention's projections split (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``)."""
    return str(getattr(config, "model_type", "")).startswith("qwen3_5")


def check_qwen3_next(config: Any) -> None:
    """Refuse, naming the field, what this module would run differently from transformers' Qwen3-Next / 3.5 (whose
    multimodal rotary sections are plain rotary for text, every section reading the same position)."""
    arch = (getattr(config, "architectures", None) or ["Qwen3NextForCausalLM"])[0]
    kinds = set(config.layer_types) - set(LAYER_KINDS)
    if kinds:
        raise UnsupportedModelError(f"{arch} layer_types {sorted(kinds)}: only {list(LAYER_KINDS)} "
                                    "layers are known")
    if config.hidden_act not in ("silu", "swish"):
        raise UnsupportedModelError(f"{arch} hidden_act {config.hidden_act!r}: only silu is "
                                    "implemented (the conv activation and the experts)")
    if config.num_attention_heads % config.num_key_value_heads:
        raise UnsupportedModelError(f"{arch} num_key_value_heads {config.num_key_value_heads} does not "
                                    f"divide num_attention_heads {config.num_attention_heads}")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise UnsupportedModelError(f"{arch} linear_num_key_heads {config.linear_num_key_heads} does "
                                    f"not divide linear_num_value_heads {config.linear_num_value_heads}")
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(f"{arch} rope_type {rope.get('rope_type')!r}: only the default "
                                    "(partial) rotary is implemented for Qwen3-Next")


class GatedRMSNorm(nn.Module):
    """transformers' ``Qwen3NextRMSNormGated``: ``weight * rms_norm(x) * silu(z)`` over the last dim (the plain
    weight, not ``1 + weight``), the norm through the backend."""

    def __init__(self, dim: int, eps: float, op):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps, self.op = eps, op

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return (self.op(x, self.weight, self.eps).float() * F.silu(z.float())).to(x.dtype)


class Qwen3NextGatedDeltaNet(nn.Module):
    """The linear-attention mixer; its conv and delta-rule states live in the request's state slot."""

    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.nk, self.nv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        h, r = config.hidden_size, self.nv // self.nk
        self.split_layout = is_qwen3_5(config)
        if self.split_layout:  # Qwen3.5: q, k, v, z, b, a each projected whole, q/k/v already in conv order
            self.in_proj_qkv = nn.Linear(h, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.nv, bias=False)
            self.in_proj_a = nn.Linear(h, self.nv, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.nv, bias=False)
        self.conv1d = StateConv1d(self.conv_dim, config.linear_conv_kernel_dim, False, backend, "silu")
        self.dt_bias = nn.Parameter(torch.empty(self.nv), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.nv), requires_grad=False)
        self.norm = GatedRMSNorm(self.dv, config.rms_norm_eps, backend.rms_norm)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.qkvz_split = [self.dk, self.dk, r * self.dv, r * self.dv]
        self.chunk_rule = backend.chunk_gated_delta_rule
        self.recurrent_rule = backend.fused_recurrent_gated_delta_rule

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``(mixed_qkv [T, conv_dim], z [T, HV, V], b [T, HV], a [T, HV])`` from the checkpoint's grouped layout
        (per key head: q, k, then its value heads' v and z; b and a likewise), as HF's
        ``fix_query_key_value_ordering``; Qwen3.5's separate projections as they are."""
        t = x.shape[0]
        if self.split_layout:
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(t, self.nv, self.dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.nk, -1).split(self.qkvz_split, dim=-1)
        b, a = self.in_proj_ba(x).view(t, self.nk, -1).chunk(2, dim=-1)
        mixed = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return mixed, z.reshape(t, self.nv, self.dv), b.reshape(t, self.nv), a.reshape(t, self.nv)

    def _prefill_rule(self, q, k, v, g, beta, states: Optional[torch.Tensor], meta: Optional[AttentionMetadata],
                      nd: int) -> torch.Tensor:
        """The chunked rule over the prefill sequences: initial states gathered from their slots (zeros for fresh
        ones), final states written back."""
        if states is None:
            return self.chunk_rule(q, k, v, g, beta, None, None, None, True)[0]
        qsl = meta.query_start_loc[nd:]
        slots = meta.state_indices[nd:].long()
        keep = meta.has_initial_state[nd:].to(states.device).view(-1, 1, 1, 1)
        init = torch.where(keep, states[slots].float(), 0.0)  # a fresh sequence never reads its slot
        out, final = self.chunk_rule(q, k, v, g, beta, None, init, qsl - qsl[0], True)
        live = slots >= 0  # -1: a padding row of a static batch shape, whose state is never written
        states[slots[live]] = final[live].to(states.dtype)
        return out

    def forward(self, x: torch.Tensor, state: Optional[tuple], meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        mixed, z, b, a = self._project(x)
        state = layer_state(state, meta)
        stateful = state is not None
        conv_states, rec_states = state or (None, None)
        nd = meta.num_decodes if stateful else 0
        mixed = self.conv1d(mixed, conv_states, meta)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(t, self.nk, self.dk), k.reshape(t, self.nk, self.dk), v.reshape(t, self.nv, self.dv)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if not stateful:
            o = self._prefill_rule(q, k, v, g, beta, None, None, 0)
        elif nd == meta.num_seqs:
            o = self.recurrent_rule(q, k, v, g, beta, None, rec_states, meta.state_indices, True)
        elif nd == 0:
            o = self._prefill_rule(q, k, v, g, beta, rec_states, meta, 0)
        else:
            o = torch.empty_like(v)
            o[:nd] = self.recurrent_rule(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], None, rec_states,
                                         meta.state_indices[:nd], True)
            o[nd:] = self._prefill_rule(q[nd:], k[nd:], v[nd:], g[nd:], beta[nd:], rec_states, meta, nd)
        return self.out_proj(self.norm(o, z).reshape(t, self.value_dim))


class Qwen3NextAttention(nn.Module):
    """Gated attention: ``o_proj((softmax(q k^T) v) * sigmoid(gate))``, q/k (1 + w) norms, partial rotary."""

    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        h = config.hidden_size
        self.q_proj = nn.Linear(h, 2 * self.num_heads * self.head_size, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_size, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_size, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_size, h, bias=bias)
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, backend.rms_norm, offset=True)
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, backend.rms_norm, offset=True)
        self.scale = self.head_size ** -0.5
        self.rotary, self.write_kv, self.paged_attention = backend.rotary, backend.write_kv, backend.paged_attention
        self.k_scale, self.v_scale = 1.0, 1.0  # fp8 KV cache scales (pagedllm.backend.kv_quant)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, gate = self.q_proj(x).view(t, self.num_heads, 2 * self.head_size).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(self.k_proj(x).view(t, self.num_kv_heads, self.head_size))
        q, k = self.rotary(positions, q, k, cos_sin_cache)
        self.write_kv(k, self.v_proj(x).view(t, self.num_kv_heads, self.head_size), kv_cache, meta.slot_mapping,
                      self.k_scale, self.v_scale)
        out = self.paged_attention(q, kv_cache, meta, self.scale, None, None, self.k_scale, self.v_scale)
        out = out.reshape(t, self.num_heads * self.head_size) * torch.sigmoid(gate.reshape(t, -1))
        return self.o_proj(out)


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, backend: Any, kind: str, index: int):
        super().__init__()
        self.is_attention = kind == "full_attention"
        if self.is_attention:
            self.self_attn = Qwen3NextAttention(config, backend)
        else:
            self.linear_attn = Qwen3NextGatedDeltaNet(config, backend)
        if is_moe_layer(config, index):
            self.mlp = SparseMoeBlock(config, backend, lambda size: GatedMLP(config, spec, backend, size))
        else:
            self.mlp = GatedMLP(config, spec, backend)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm, offset=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm,
                                                offset=True)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        if self.is_attention:
            h = h + self.self_attn(x, positions, cache, meta, cos_sin_cache)
        else:
            h = h + self.linear_attn(x, cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextCausalLM(StatefulCausalLM):
    """Qwen3-Next behind pagedllm's model interface (models/stateful_lm.py): the full-attention layers' paged caches,
    the linear-attention layers' (conv, delta-rule) state pairs."""

    def __init__(self, config: Any, spec: ArchSpec, backend: Any):
        check_qwen3_next(config)
        kinds = list(config.layer_types)
        key_dim = config.linear_num_key_heads * config.linear_key_head_dim
        conv_dim = 2 * key_dim + config.linear_num_value_heads * config.linear_value_head_dim
        super().__init__(config, spec, num_layers=kinds.count("full_attention"),
                         num_state_layers=kinds.count("linear_attention"), state_shapes=(
                             (conv_dim, config.linear_conv_kernel_dim - 1),
                             (config.linear_num_value_heads, config.linear_key_head_dim,
                              config.linear_value_head_dim)))
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, spec, backend, k, i) for i, k in enumerate(kinds))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm, offset=True)
        self.requires_grad_(False)

    @property
    def state_dtypes(self) -> tuple:
        """The conv state in the model's dtype (HF's cache holds the conv input in it), the delta-rule state in
        float32 (HF's torch kernels and FLA's keep it so)."""
        return (self.dtype, torch.float32)
