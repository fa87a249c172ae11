"""Mamba2 natively (``Mamba2ForCausalLM``): the Mamba2 mixer, reused by the hybrid Granite-4.0-H
(``models/granite_hybrid.py``), and the pure Mamba2 language model.

A mixer (transformers' ``Mamba2Mixer``) projects ``h`` to ``gate, xBC, dt``; convolves ``xBC`` causally and depthwise
(SiLU) over ``conv_kernel`` tokens; splits it into ``x, B, C`` and runs the selective state space (SSD) with per-head
``dt``, ``A = -exp(A_log)``, ``D`` and ``dt_bias``; then ``out_proj`` of the gated, group-wise RMSNorm of
``y * silu(gate)``. Its state is two tensors per layer (contract v3: one ``hookspec.MambaSpec`` holding both): the
conv state ``[conv_dim, conv_kernel - 1]`` and the SSM state ``[num_heads, head_dim, d_state]``, both kept in the
model's dtype (vLLM's ``mamba_ssm_cache_dtype="auto"``), indexed by ``AttentionMetadata.state_indices``. Prefill
chunks run the backend's ``causal_conv1d_fn`` and ``mamba_chunk_scan_combined`` (continuing from the slot when
``has_initial_state``; the final states are written back), decode tokens ``causal_conv1d_update`` and
``selective_state_update``, exactly as LFM2's short convolutions do (``models/lfm2.py``). ``time_step_limit`` clamps
``dt`` in the chunked scan only, as transformers' and vLLM's decode kernels leave it unclamped.

The pure model has no attention layer: its paged KV group is empty (``num_layers == 0``, blocks cost nothing), the
scheduler's block tables still bound each sequence. Parameter names are the checkpoint's (``backbone.*``).
Without state slots in the metadata (profiling and warm-up forwards) every sequence starts from zeros and keeps
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import EMPTY_KV_HEAD_SIZE
from pagedllm.models.causal_lm import RMSNorm
from pagedllm.models.stateful_lm import StateConv1d, StatefulCausalLM, layer_state, token_embedding

#: Mamba2 has no position limit and its configs name none: the longest sequence served unless the config sets
#: ``max_position_embeddings``.
DEFAULT_MAX_POSITIONS = 8192


@dataclass(frozen=True)
class Mamba2Dims:
    """A Mamba2 mixer's geometry and options, read from either family's config field names."""

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    conv_kernel: int
    chunk_size: int
    intermediate_size: int
    use_bias: bool
    use_conv_bias: bool
    eps: float
    time_step_limit: tuple[float, float]

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """(conv state, SSM state) of one layer: vLLM's shapes."""
        return (self.conv_dim, self.conv_kernel - 1), (self.num_heads, self.head_dim, self.d_state)

    def check(self, arch: str, hidden_act: str) -> None:
        """Refuse, naming the field, what the mixer would run differently from transformers."""
        if hidden_act != "silu":
            raise UnsupportedModelError(f"{arch} hidden_act {hidden_act!r}: the Mamba2 convolution runs SiLU only")
        if self.num_heads * self.head_dim != self.intermediate_size:
            raise UnsupportedModelError(f"{arch}: num_heads {self.num_heads} x head_dim {self.head_dim} must equal "
                                        f"the mixer's intermediate size {self.intermediate_size}")
        if self.num_heads % self.n_groups or self.intermediate_size % self.n_groups:
            raise UnsupportedModelError(f"{arch} n_groups {self.n_groups} must divide num_heads {self.num_heads}")


def step_limit(value: Any) -> tuple[float, float]:
    lo, hi = value if value is not None else (0.0, float("inf"))
    return float(lo), float(hi)


def mamba2_dims(config: Any) -> Mamba2Dims:
    """``Mamba2Config``'s field names."""
    return Mamba2Dims(config.hidden_size, config.num_heads, config.head_dim, config.n_groups, config.state_size,
                      config.conv_kernel, config.chunk_size, int(config.expand * config.hidden_size),
                      bool(config.use_bias), bool(config.use_conv_bias), config.layer_norm_epsilon,
                      step_limit(config.time_step_limit))


class GatedRMSNorm(nn.Module):
    """transformers' ``Mamba2RMSNormGated`` (norm after the gate): ``w * rms_norm_per_group(y * silu(gate))``, in
    float32."""

    def __init__(self, dim: int, group_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.group_size, self.eps = group_size, eps

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() * F.silu(gate.float())
        g = h.view(*h.shape[:-1], -1, self.group_size)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """in_proj -> causal conv1d (SiLU) over xBC -> SSD / selective state update -> gated RMSNorm -> out_proj; the
    state ``(conv_states, ssm_states)`` of this layer is the request's slot in each."""

    def __init__(self, dims: Mamba2Dims, backend: Any):
        super().__init__()
        self.dims = d = dims
        self.in_proj = nn.Linear(d.hidden_size, d.intermediate_size + d.conv_dim + d.num_heads, bias=d.use_bias)
        self.conv1d = StateConv1d(d.conv_dim, d.conv_kernel, d.use_conv_bias, backend, "silu")
        self.dt_bias = nn.Parameter(torch.empty(d.num_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(d.num_heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(d.num_heads), requires_grad=False)
        self.norm = GatedRMSNorm(d.intermediate_size, d.intermediate_size // d.n_groups, d.eps)
        self.out_proj = nn.Linear(d.intermediate_size, d.hidden_size, bias=d.use_bias)
        self.chunk_scan, self.state_update = backend.mamba_chunk_scan_combined, backend.selective_state_update

    def _scan(self, x: torch.Tensor, dt: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
              ssm_states: Optional[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        d = self.dims
        A = -torch.exp(self.A_log.float())
        D, bias, limit = self.D, self.dt_bias, d.time_step_limit
        if ssm_states is None:  # profiling / warm-up: every sequence from zeros
            return self.chunk_scan(x, dt, A, B, C, d.chunk_size, meta.query_start_loc, None, D, None, bias, True,
                                   limit)[0]
        nd, qsl, idx = meta.num_decodes, meta.query_start_loc, meta.state_indices
        y = torch.empty_like(x)
        if nd:
            y[:nd] = self.state_update(ssm_states, x[:nd], dt[:nd], A, B[:nd], C[:nd], D, None, bias, True, idx[:nd])
        if nd < meta.num_seqs:
            slots = idx[nd:].long()
            fresh = ~meta.has_initial_state[nd:].to(torch.bool)
            init = ssm_states[slots].float().masked_fill(fresh[:, None, None, None], 0.0)
            lo = int(qsl[nd])
            y[lo:], final = self.chunk_scan(x[lo:], dt[lo:], A, B[lo:], C[lo:], d.chunk_size, qsl[nd:] - lo, init, D,
                                            None, bias, True, limit)
            live = slots >= 0  # -1: a padding row of a static batch shape, whose state is never written
            ssm_states[slots[live]] = final[live].to(ssm_states.dtype)
        return y

    def forward(self, h: torch.Tensor, state: Optional[tuple], meta: AttentionMetadata) -> torch.Tensor:
        d = self.dims
        t = h.shape[0]
        gate, xbc, dt = self.in_proj(h).split([d.intermediate_size, d.conv_dim, d.num_heads], dim=-1)
        conv_states, ssm_states = layer_state(state, meta) or (None, None)
        xbc = self.conv1d(xbc, conv_states, meta)
        gs = d.n_groups * d.d_state
        x, B, C = xbc.split([d.intermediate_size, gs, gs], dim=-1)
        y = self._scan(x.reshape(t, d.num_heads, d.head_dim), dt, B.reshape(t, d.n_groups, d.d_state),
                       C.reshape(t, d.n_groups, d.d_state), ssm_states, meta)
        return self.out_proj(self.norm(y.reshape(t, d.intermediate_size), gate))


class Mamba2Block(nn.Module):
    is_attention = False

    def __init__(self, config: Any, dims: Mamba2Dims, backend: Any):
        super().__init__()
        self.residual_in_fp32 = bool(getattr(config, "residual_in_fp32", False))
        self.norm = RMSNorm(config.hidden_size, config.layer_norm_epsilon, backend.rms_norm)
        self.mixer = Mamba2Mixer(dims, backend)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, state: Optional[tuple], meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        residual = h.float() if self.residual_in_fp32 else h
        out = self.mixer(self.norm(h.to(self.norm.weight.dtype)), state, meta)
        return residual + out


class Mamba2Backbone(nn.Module):
    def __init__(self, config: Any, dims: Mamba2Dims, backend: Any):
        super().__init__()
        self.embeddings = token_embedding(config)
        self.layers = nn.ModuleList(Mamba2Block(config, dims, backend) for _ in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon, backend.rms_norm)


class Mamba2CausalLM(StatefulCausalLM):
    """Pure Mamba2 behind pagedllm's model interface (models/stateful_lm.py): no paged KV layer
    (``num_layers == 0``), each layer's ``(conv_states, ssm_states)``."""

    checkpoint_names = True  # parameter names are the checkpoint's (backbone.*, lm_head)

    def __init__(self, config: Any, spec: Any, backend: Any):
        dims = mamba2_dims(config)
        dims.check("Mamba2ForCausalLM", config.hidden_act)
        super().__init__(config, spec, num_layers=0, num_state_layers=config.num_hidden_layers,
                         state_shapes=dims.state_shapes, kv_shape=(1, 1, EMPTY_KV_HEAD_SIZE),
                         max_model_len=getattr(config, "max_position_embeddings", None) or DEFAULT_MAX_POSITIONS,
                         embedding=False)
        self.backbone = Mamba2Backbone(config, dims, backend)
        self.requires_grad_(False)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.backbone.embeddings

    @property
    def layers(self) -> nn.ModuleList:
        return self.backbone.layers

    @property
    def state_dtypes(self) -> tuple:
        """Both states in the model's dtype (vLLM's default ``mamba_ssm_cache_dtype``)."""
        return self.dtype, self.dtype

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm_f(h.to(self.backbone.norm_f.weight.dtype))
