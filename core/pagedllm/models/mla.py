"""DeepSeek-V2/V3 multi-head latent attention (MLA) with the compressed latent in the paged KV cache.

Per token the cache holds one row: ``kv_a_layernorm(c)`` (``kv_lora_rank``) then the rotated shared rope key
(``qk_rope_head_dim``), never the per-head keys and values (``KVCacheSpec.mla``). Attention runs in the absorbed form
(as vLLM's MLA backends): the no-rope query is multiplied into latent space by each head's key up-projection
(``W_UK``), every head attends to the latent rows (``pagedllm_mla_attention``), and the latent output is lifted by the
value up-projection (``W_UV``) -- the same scores and values as HF's expanded form, at latent-size memory.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedllm.backend.attention import AttentionMetadata


def mla_softmax_scale(config: Any) -> float:
    """HF's scale: ``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN."""
    from transformers.modeling_rope_utils import yarn_apply_mscale  # heavy: transformers

    return float(yarn_apply_mscale(getattr(config, "rope_parameters", None) or {},
                                   (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5))


def rope_interleaved(config: Any) -> bool:
    """DeepSeek checkpoints rotate interleaved pairs (V2 always; V3 unless ``rope_interleave`` is false)."""
    return config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", True))


class UpProjection(nn.Linear):
    """``kv_b_proj``: read as a weight (split into per-head ``W_UK`` / ``W_UV``), never applied as a linear layer,
    so it is not an ``nn.Linear`` to code that swaps linear layers for backend kernels."""


class MLAAttention(nn.Module):
    def __init__(self, config: Any, backend: Any, rms_norm_cls: Any):
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        q_out = self.num_heads * (self.nope + self.rope)
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = rms_norm_cls(self.q_lora_rank, 1e-6)  # HF's DeepseekV*RMSNorm default eps
            self.q_b_proj = nn.Linear(self.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = rms_norm_cls(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = UpProjection(self.kv_lora_rank, self.num_heads * (self.nope + self.v_head_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, h, bias=bias)
        self.scale = mla_softmax_scale(config)
        self.interleaved = rope_interleaved(config)
        self.rotary, self.write_mla_kv, self.mla_attention = backend.rotary, backend.write_mla_kv, \
            backend.mla_attention

    def _deinterleave(self, x: torch.Tensor) -> torch.Tensor:
        """Pairs (x0, x1), (x2, x3)... -> (x0, x2, ..., x1, x3, ...): HF's interleaved rotation is then the neox one
        (q and k get the same permutation, so their dot products are unchanged)."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe, k_pe = self.rotary(positions, self._deinterleave(q_pe), self._deinterleave(k_pe).view(t, 1, self.rope),
                                 cos_sin_cache)
        if meta.kv_connector is not None:  # the layer's KV-connector loads land before it reads its cache
            meta.kv_connector.wait_for_layer_load(kv_cache)
        self.write_mla_kv(torch.cat((c, k_pe.view(t, self.rope)), dim=-1), kv_cache, meta.slot_mapping)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]
        q_latent = torch.einsum("thn,hnl->thl", q_nope, w_uk)
        out = self.mla_attention(torch.cat((q_latent, q_pe), dim=-1), kv_cache, meta, self.scale, self.kv_lora_rank)
        if meta.kv_connector is not None:  # and its new K/V may be saved once written
            meta.kv_connector.save_kv_layer(kv_cache, meta)
        out = torch.einsum("thl,hvl->thv", out, w_uv).reshape(t, self.num_heads * self.v_head_dim)
        return self.o_proj(out)
