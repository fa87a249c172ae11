"""StableLM natively (``StableLmForCausalLM``: StableLM-3B-4E1T, StableLM 2), running attention through the backend's
paged hooks.

Llama's GQA and gated MLP with what transformers' StableLM changes: LayerNorm with bias (not RMSNorm), a partial rotary
over the first ``head_size * partial_rotary_factor`` features (0.25 by default), q/k/v bias (``use_qkv_bias``), a
parallel residual (``use_parallel_residual``: attention and MLP both read the input norm, GPT-NeoX style, no
``post_attention_layernorm``) and a bias-free LayerNorm per head on q and k (``qk_layernorm``, StableLM 2 12B).

Parameter names are HF's under the loader's ``model.`` prefix, with q/k/v and gate/up fused as in ``CausalLM``, so
safetensors, GGUF (llama.cpp stacks the per-head norms: ``models/gguf_weights.py`` reads one head's row), packed
quantized linears and the backend's dense kernels load it as they load the native decoder. A config this module
cannot run as HF runs it is refused naming the field (``check_stablelm``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.causal_lm import CausalLM


def _activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN  # heavy: transformers

    return ACT2FN[name]


def rotary_width(config: Any, head_size: int) -> int:
    """The rotated features of a head, as HF's StableLM attention takes them (a factor of 0 rotates nothing)."""
    params = getattr(config, "rope_parameters", None) or {}
    return int(head_size * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 0.25)))


def check_stablelm(config: Any) -> None:
    """Refuse, naming the field, what HF's StableLM would run differently from this module (or not at all)."""
    heads, hidden = config.num_attention_heads, config.hidden_size
    if hidden % heads:
        raise UnsupportedModelError(f"StableLmForCausalLM hidden_size {hidden} is not a multiple of "
                                    f"num_attention_heads {heads}")
    head_size = hidden // heads
    head_dim = getattr(config, "head_dim", None)
    if head_dim is not None and head_dim != head_size:  # HF's attention ignores it, its rotary does not
        raise UnsupportedModelError(f"StableLmForCausalLM head_dim {head_dim} differs from hidden_size / "
                                    f"num_attention_heads ({head_size}); transformers' StableLM uses both")
    if heads % config.num_key_value_heads:
        raise UnsupportedModelError(f"StableLmForCausalLM num_key_value_heads {config.num_key_value_heads} does not "
                                    f"divide num_attention_heads {heads}")
    rot = rotary_width(config, head_size)
    if rot % 2 or not 0 <= rot <= head_size:
        raise UnsupportedModelError(f"StableLmForCausalLM partial_rotary_factor gives a rotary width of {rot} of a "
                                    f"{head_size}-wide head: it must be even and at most the head")
    act = getattr(config, "hidden_act", "silu")
    from transformers.activations import ACT2CLS  # heavy: transformers

    if act not in ACT2CLS:
        raise UnsupportedModelError(f"StableLmForCausalLM hidden_act {act!r} is not an activation transformers "
                                    "defines")


class PerHeadLayerNorm(nn.Module):
    """HF's ``StableLmLayerNormPerHead``: a bias-free LayerNorm over each head with that head's own weight
    (``norms.H.weight``), run for all heads at once as a group norm of ``heads`` groups over ``[T, heads * dim]``
    (per-channel weight: the heads' weights in order), which is the same arithmetic."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(dim, eps=eps, bias=False) for _ in range(num_heads))
        self.num_heads, self.eps = num_heads, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = torch.cat([n.weight for n in self.norms])
        return F.group_norm(x.reshape(x.shape[0], -1), self.num_heads, weight, None, self.eps).view_as(x)


class StableLmAttention(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=bool(config.use_qkv_bias))
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        if config.qk_layernorm:
            eps = config.layer_norm_eps
            self.q_layernorm = PerHeadLayerNorm(self.head_size, self.num_heads, eps)
            self.k_layernorm = PerHeadLayerNorm(self.head_size, self.num_kv_heads, eps)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.scale = self.head_size ** -0.5
        self.rotary_dim = rotary_width(config, self.head_size)
        self.rotary, self.write_kv, self.paged_attention = backend.rotary, backend.write_kv, backend.paged_attention
        self.k_scale, self.v_scale = 1.0, 1.0  # fp8 KV cache scales (pagedllm.backend.kv_quant)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        q = q.view(t, self.num_heads, self.head_size)
        k = k.view(t, self.num_kv_heads, self.head_size)
        v = v.view(t, self.num_kv_heads, self.head_size)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary_dim:
            q, k = self.rotary(positions, q, k, cos_sin_cache)
        if meta.kv_connector is not None:  # the layer's KV-connector loads land before it reads its cache
            meta.kv_connector.wait_for_layer_load(kv_cache)
        self.write_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        out = self.paged_attention(q, kv_cache, meta, self.scale, None, None, self.k_scale, self.v_scale)
        if meta.kv_connector is not None:  # and its new K/V may be saved once written
            meta.kv_connector.save_kv_layer(kv_cache, meta)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_size))


class StableLmMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, no biases; silu through the backend's ``silu_and_mul``, any other
    ``hidden_act`` through transformers' own activation."""

    def __init__(self, config: Any, backend: Any):
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.silu_and_mul = backend.silu_and_mul if act in ("silu", "swish") else None
        self.act = None if self.silu_and_mul is not None else _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class StableLmDecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(h, eps=eps)
        self.self_attn = StableLmAttention(config, backend)
        self.mlp = StableLmMLP(config, backend)
        self.post_attention_layernorm = None if config.use_parallel_residual else nn.LayerNorm(h, eps=eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        x = self.input_layernorm(h)
        a = self.self_attn(x, positions, kv_cache, meta, cos_sin_cache)
        if self.post_attention_layernorm is None:  # parallel residual: h + attn(ln(h)) + mlp(ln(h))
            return (h + a) + self.mlp(x)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h))


class StableLmCausalLM(nn.Module):
    """StableLM behind pagedllm's model interface (``forward(ids, positions, meta)``, ``compute_logits``,
    ``kv_caches``, shapes). Single rank (the loader refuses tensor/pipeline parallel); no LoRA."""

    supports_lora = False
    kv_cache_mla = False

    def __init__(self, config: Any, spec: Any, backend: Any):
        super().__init__()
        check_stablelm(config)
        self.config, self.spec = config, spec
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = config.num_key_value_heads
        self.head_size: int = config.hidden_size // config.num_attention_heads
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = config.max_position_embeddings
        self.layer_sliding_windows: list[Optional[int]] = [None] * self.num_layers
        self.sliding_window: Optional[int] = None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.eos_token_ids: list[int] = []
        self.kv_caches: list = []
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(StableLmDecoderLayer(config, backend) for _ in range(self.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.lm_head_kernel: Optional[tuple] = None  # (apply, state) of a backend dense kernel, set by the loader
        self.rope_caches: dict[str, torch.Tensor] = {}
        self.requires_grad_(False)

    # the same embedding/LM-head attributes as CausalLM, so the same accessors
    dtype, device, lm_head_weight = CausalLM.dtype, CausalLM.device, CausalLM.lm_head_weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, self.kv_caches, strict=True):
            h = layer(h, positions, kv_cache, meta, self.cos_sin_cache)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_kernel is not None:
            apply, state = self.lm_head_kernel
            return apply(state, hidden, None)
        return F.linear(hidden, self.lm_head_weight)
