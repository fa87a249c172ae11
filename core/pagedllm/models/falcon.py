"""Falcon natively (``FalconForCausalLM``): LayerNorm, a plain gelu MLP, one fused ``query_key_value`` in three
layouts, parallel attention + MLP, running attention through the backend's paged hooks.

Layouts of ``query_key_value`` (read as views, no re-layout at load, so checkpoint names load unchanged):
``new_decoder_architecture`` (Falcon-40B/180B, Falcon 2): per KV group its queries, then its key and value, with two
layernorms (``ln_attn``/``ln_mlp``) unless ``num_ln_in_parallel_attn`` is 1; ``multi_query`` (Falcon-7B): all queries,
then one key and one value; else (Falcon-RW style) query, key, value interleaved per head. ALiBi (``alibi=True``,
Falcon-RW): no rotary; the slopes go to the paged attention hook pre-multiplied by ``1/sqrt(head_size)``, since HF's
Falcon adds the bias before scaling the scores (as vLLM's Falcon does). HF computes the bias
``slope * position`` in bfloat16 (legacy); we keep it in float32.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.alibi import alibi_slopes

_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def falcon_kv_heads(config: Any) -> int:
    """KV heads as HF's attention picks them (the config's ``num_key_value_heads`` property aside)."""
    if config.new_decoder_architecture:
        return config.num_kv_heads
    return 1 if config.multi_query else config.num_attention_heads


def check_falcon(config: Any) -> None:
    if getattr(config, "activation", "gelu") not in _ACTIVATIONS:
        raise UnsupportedModelError(f"FalconForCausalLM activation {config.activation!r} is not implemented "
                                    f"(supported: {', '.join(_ACTIVATIONS)})")


class FalconAttention(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // self.num_heads
        self.num_kv_heads = falcon_kv_heads(config)
        self.layout = ("grouped" if config.new_decoder_architecture else "mqa" if config.multi_query else "per_head")
        out = (self.num_heads + 2 * self.num_kv_heads) * self.head_size
        self.query_key_value = nn.Linear(config.hidden_size, out, bias=config.bias)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=config.bias)
        self.scale = 1.0 / math.sqrt(self.head_size)
        self.rotary, self.write_kv, self.paged_attention = backend.rotary, backend.write_kv, backend.paged_attention
        self.k_scale, self.v_scale = 1.0, 1.0  # fp8 KV cache scales (pagedllm.backend.kv_quant)
        # Made on first use, on the query's device (the module may be built on the meta device): float32 whatever
        # the model dtype. Exact slopes as vLLM's Falcon; HF's build_alibi_tensor computes slope * position in bfloat16
        # (the original Falcon code did), which moves fp32 logits by ~5e-3.
        self.alibi = bool(getattr(config, "alibi", False))
        self.alibi_slopes: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t, d = x.shape[0], self.head_size
        qkv = self.query_key_value(x)
        if self.layout == "grouped":
            g = qkv.view(t, self.num_kv_heads, -1, d)
            q, k, v = g[:, :, :-2].reshape(t, self.num_heads, d), g[:, :, -2], g[:, :, -1]
        elif self.layout == "mqa":
            q, k, v = qkv.view(t, -1, d).split([self.num_heads, 1, 1], dim=1)
        else:
            q, k, v = qkv.view(t, self.num_heads, 3, d).unbind(2)
        if meta.kv_connector is not None:  # the layer's KV-connector loads land before it reads its cache
            meta.kv_connector.wait_for_layer_load(kv_cache)
        if self.alibi:
            if self.alibi_slopes is None or self.alibi_slopes.device != q.device:
                self.alibi_slopes = (alibi_slopes(self.num_heads) * self.scale).to(q.device)
            self.write_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            out = self.paged_attention(q, kv_cache, meta, self.scale, None, None, self.k_scale, self.v_scale,
                                       alibi_slopes=self.alibi_slopes)
        else:
            q, k = self.rotary(positions, q, k, cos_sin_cache)
            self.write_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            out = self.paged_attention(q, kv_cache, meta, self.scale, None, None, self.k_scale, self.v_scale)
        if meta.kv_connector is not None:  # and its new K/V may be saved once written
            meta.kv_connector.save_kv_layer(kv_cache, meta)
        return self.dense(out.reshape(t, self.num_heads * d))


class FalconMLP(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        ffn = getattr(config, "ffn_hidden_size", None) or 4 * config.hidden_size
        self.dense_h_to_4h = nn.Linear(config.hidden_size, ffn, bias=config.bias)
        self.dense_4h_to_h = nn.Linear(ffn, config.hidden_size, bias=config.bias)
        self.act = _ACTIVATIONS[getattr(config, "activation", "gelu")]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class FalconDecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: Any):
        super().__init__()
        h, eps = config.hidden_size, config.layer_norm_epsilon
        self.self_attention = FalconAttention(config, backend)
        self.mlp = FalconMLP(config)
        self.parallel = bool(config.parallel_attn) or bool(config.new_decoder_architecture)
        n_ln = config.num_ln_in_parallel_attn
        self.two_norms = bool(config.new_decoder_architecture) and (n_ln is None or n_ln == 2)
        if self.two_norms:
            self.ln_attn, self.ln_mlp = nn.LayerNorm(h, eps=eps), nn.LayerNorm(h, eps=eps)
        else:
            self.input_layernorm = nn.LayerNorm(h, eps=eps)
            if not self.parallel:
                self.post_attention_layernorm = nn.LayerNorm(h, eps=eps)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        x = self.ln_attn(h) if self.two_norms else self.input_layernorm(h)
        a = self.self_attention(x, positions, kv_cache, meta, cos_sin_cache)
        if not self.parallel:  # sequential (parallel_attn=False): attention, then the MLP on its own norm
            h = a + h
            return self.mlp(self.post_attention_layernorm(h)) + h
        m = self.mlp(self.ln_mlp(h) if self.two_norms else x)
        return (m + a) + h


class FalconCausalLM(nn.Module):
    """Falcon behind pagedllm's model interface (``forward(ids, positions, meta)``, ``compute_logits``,
    ``kv_caches``, shapes). Parameter names are the checkpoint's (``transformer.h.N...``)."""

    supports_lora = False
    kv_cache_mla = False
    checkpoint_names = True  # parameter names are the checkpoint's (no "model." prefix)

    def __init__(self, config: Any, spec: Any, backend: Any):
        super().__init__()
        check_falcon(config)
        self.config, self.spec = config, spec
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        self.num_kv_heads: int = falcon_kv_heads(config)
        self.head_size: int = config.hidden_size // config.num_attention_heads
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = config.max_position_embeddings
        self.layer_sliding_windows: list[Optional[int]] = [None] * self.num_layers
        self.sliding_window: Optional[int] = None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.eos_token_ids: list[int] = []
        self.kv_caches: list = []
        self.transformer = nn.Module()
        self.transformer.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.transformer.h = nn.ModuleList(FalconDecoderLayer(config, backend) for _ in range(self.num_layers))
        self.transformer.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.lm_head_kernel: Optional[tuple] = None  # (apply, state) of a backend dense kernel, set by the loader
        self.rope_caches: dict[str, torch.Tensor] = {}
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.word_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.word_embeddings.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.transformer.word_embeddings.weight if self.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.transformer.word_embeddings(input_ids)
        for layer, kv_cache in zip(self.transformer.h, self.kv_caches, strict=True):
            h = layer(h, positions, kv_cache, meta, self.cos_sin_cache)
        return self.transformer.ln_f(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_kernel is not None:
            apply, state = self.lm_head_kernel
            return apply(state, hidden, None)
        return F.linear(hidden, self.lm_head_weight)
