"""One native decoder (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral, Qwen2-MoE, DeepSeek-V2/V3, GPT-OSS) running
attention through a pagedllm backend.

Flat batch, no batch dimension: ``T`` tokens of many sequences, described by an ``AttentionMetadata``. q/k/v and
gate/up are fused into one matmul each (as vLLM does); hot-path ops are the backend's resolved plain functions.
Call under ``torch.inference_mode()``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.errors import UnsupportedModelError
from pagedllm.models.arch import ArchSpec, hidden_act, kv_cache_shape, layer_sliding_windows
from pagedllm.models.mla import MLAAttention
from pagedllm.models.alibi import alibi_slopes
from pagedllm.models.gpt_oss import GptOssMoeBlock
from pagedllm.models.moe import DeepseekMoeBlock, SparseMoeBlock, is_moe_layer
from pagedllm.models.quantized_embedding import QuantizedEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, op, offset: bool = False, fused_add_op=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.eps = eps
        self.op = op
        self.fused_add_op = fused_add_op  # the backend's own fused_add_rms_norm, else None (add_, then op)
        self.offset = offset  # Gemma stores w and scales by (1 + w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.op(x, self.weight + 1 if self.offset else self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x += residual`` (in place), then the norm of that sum: (normed, sum); one call where the backend fuses
        them, else its ``rms_norm`` after the add (not core's reference, which would replace a backend's norm)."""
        if self.fused_add_op is None:
            return self(x.add_(residual)), x
        return self.fused_add_op(x, residual, self.weight + 1 if self.offset else self.weight, self.eps)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): ``gelu_tanh(x[..., :d]) * x[..., d:]``."""
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def rotary_dim(config: Any, head_size: int) -> int:
    """Rotary width: ``head_size`` times ``partial_rotary_factor`` (config or ``rope_parameters``)."""
    params = getattr(config, "rope_parameters", None) or {}
    return int(head_size * (params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
                            or 1.0))


def deinterleave(x: torch.Tensor, rot: int) -> torch.Tensor:
    """The first ``rot`` features reordered (x0, x1, x2, x3...) -> (x0, x2, ..., x1, x3, ...); the rest kept."""
    r = x[..., :rot].unflatten(-1, (rot // 2, 2)).transpose(-1, -2).flatten(-2)
    return torch.cat((r, x[..., rot:]), dim=-1) if rot < x.shape[-1] else r


class Attention(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, backend: Any, sliding_window: Optional[int]):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        self.split_sizes = [q_size, kv_size, kv_size]
        self.head_splits = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias(config))
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=spec.o_bias(config))
        if spec.qk_norm:
            self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps, backend.rms_norm, spec.gemma)
            self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps, backend.rms_norm, spec.gemma)
        else:
            self.q_norm = self.k_norm = None
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_size) ** -0.5
        self.sliding_window = sliding_window
        self.kv_group = 0  # its KV group (sched/kv_groups.py): which block table of the step's metadata it reads
        # GLM rotates interleaved pairs of the rotary dims: de-interleaving q and k alike (dot products unchanged)
        # makes that the neox rotation of the backend's rotary hook.
        self.rope_interleaved_dim = rotary_dim(config, self.head_size) if spec.rope_interleaved else 0
        self.soft_cap = getattr(config, "attn_logit_softcapping", None)
        self.rotary, self.write_kv, self.paged_attention = backend.rotary, backend.write_kv, backend.paged_attention
        # FP8 KV cache scales (pagedllm.backend.kv_quant): the checkpoint's k_scale / v_scale when it has them, else 1.0.
        self.k_scale, self.v_scale = 1.0, 1.0
        # ALiBi instead of rotary (Baichuan-13B): slopes made on first use on the query's device (meta-device build).
        self.alibi = bool(getattr(config, "pagedllm_alibi", False))
        self.alibi_slopes: Optional[torch.Tensor] = None
        # GPT-OSS: a learned sink logit per head (float32 [num_heads] for the hook; cast once per call if not).
        self.sinks = nn.Parameter(torch.empty(self.num_heads), requires_grad=False) if spec.sinks else None
        self.add_lora = getattr(backend, "add_lora", None)
        self.lora_qkv: Optional[tuple] = None  # (A, B) slot stacks, set by the LoRA manager
        self.lora_o: Optional[tuple] = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        if meta.kv_group_tables is not None:
            meta = meta.for_kv_group(self.kv_group)
        if meta.kv_connector is not None:  # the layer's KV-connector loads land before it reads its cache
            meta.kv_connector.wait_for_layer_load(kv_cache)
        lora = getattr(meta, "lora_mapping", None)
        qkv = self.qkv_proj(x)
        if lora is not None:
            self.add_lora(qkv, x, *self.lora_qkv, lora)
        # one view and one split (the same [T, heads, D] views as splitting first): fewer ops per layer at decode
        q, k, v = qkv.view(t, -1, self.head_size).split(self.head_splits, dim=1)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_interleaved_dim:
            q, k = deinterleave(q, self.rope_interleaved_dim), deinterleave(k, self.rope_interleaved_dim)
        if self.alibi:
            if self.alibi_slopes is None or self.alibi_slopes.device != q.device:
                self.alibi_slopes = alibi_slopes(self.num_heads).to(q.device)
            self.write_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            out = self.paged_attention(q, kv_cache, meta, self.scale, self.sliding_window, self.soft_cap, self.k_scale,
                                       self.v_scale, alibi_slopes=self.alibi_slopes)
        else:
            q, k = self.rotary(positions, q, k, cos_sin_cache)
            self.write_kv(k, v, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
            if self.sinks is not None:
                out = self.paged_attention(q, kv_cache, meta, self.scale, self.sliding_window, self.soft_cap,
                                           self.k_scale, self.v_scale, sinks=self.sinks.float())
            else:
                out = self.paged_attention(q, kv_cache, meta, self.scale, self.sliding_window, self.soft_cap,
                                           self.k_scale, self.v_scale)
        if meta.kv_connector is not None:  # and its new K/V may be saved once written
            meta.kv_connector.save_kv_layer(kv_cache, meta)
        out = out.reshape(t, self.num_heads * self.head_size)
        y = self.o_proj(out)
        if lora is not None:
            self.add_lora(y, out, *self.lora_o, lora)
        return y


class GatedMLP(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, backend: Any, intermediate_size: Optional[int] = None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        act = hidden_act(config)
        if act not in ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r}: pagedllm models implement silu and "
                                        "gelu_pytorch_tanh")
        bias = spec.mlp_bias(config)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=bias)
        self.silu_and_mul = backend.silu_and_mul if act in ("silu", "swish") else gelu_tanh_and_mul
        self.add_lora = getattr(backend, "add_lora", None)
        self.lora_gate_up: Optional[tuple] = None
        self.lora_down: Optional[tuple] = None

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))
        gu = self.gate_up_proj(x)
        self.add_lora(gu, x, *self.lora_gate_up, lora)
        h = self.silu_and_mul(gu)
        y = self.down_proj(h)
        self.add_lora(y, h, *self.lora_down, lora)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: ArchSpec, backend: Any, sliding_window: Optional[int], index: int):
        super().__init__()
        fused = backend.fused_add_rms_norm if backend.implements("pagedllm_fused_add_rms_norm") else None
        norm = lambda: RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm, spec.gemma,  # noqa: E731
                               fused)
        self.input_layernorm = norm()
        if spec.attention == "mla":
            self.self_attn = MLAAttention(config, backend, lambda d, eps: RMSNorm(d, eps, backend.rms_norm))
        else:
            self.self_attn = Attention(config, spec, backend, sliding_window)
        self.post_attention_layernorm = norm()
        # Gemma: post_attention_layernorm normalises the attention output; the MLP has its own pre/post norms.
        self.pre_feedforward_layernorm = norm() if spec.gemma else None
        self.post_feedforward_layernorm = norm() if spec.gemma else None
        # Glm4: the attention output and the MLP output are normed before their residual adds.
        self.post_self_attn_layernorm = norm() if spec.glm4_norms else None
        self.post_mlp_layernorm = norm() if spec.glm4_norms else None
        if spec.moe == "deepseek":
            self.mlp = (DeepseekMoeBlock(config, backend, lambda size: GatedMLP(config, spec, backend, size))
                        if index >= config.first_k_dense_replace else GatedMLP(config, spec, backend))
        elif spec.moe == "gpt_oss":
            self.mlp = GptOssMoeBlock(config)
        elif spec.moe != "none" and is_moe_layer(config, index):
            shared = (lambda size: GatedMLP(config, spec, backend, size)) if spec.moe == "shared" else None
            self.mlp = SparseMoeBlock(config, backend, shared)
        else:
            self.mlp = GatedMLP(config, spec, backend)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, kv_cache: Any, meta: AttentionMetadata,
                cos_sin_cache: torch.Tensor) -> torch.Tensor:
        if self.pre_feedforward_layernorm is not None:
            a = self.self_attn(self.input_layernorm(h), positions, kv_cache, meta, cos_sin_cache)
            x, h = self.pre_feedforward_layernorm.add_and_norm(self.post_attention_layernorm(a), h)
            m = self.mlp(x, getattr(meta, "lora_mapping", None))
            return self.post_feedforward_layernorm(m).add_(h)
        if self.post_self_attn_layernorm is not None:
            a = self.self_attn(self.input_layernorm(h), positions, kv_cache, meta, cos_sin_cache)
            x, h = self.post_attention_layernorm.add_and_norm(self.post_self_attn_layernorm(a), h)
            m = self.mlp(x, getattr(meta, "lora_mapping", None))
            return self.post_mlp_layernorm(m).add_(h)
        a = self.self_attn(self.input_layernorm(h), positions, kv_cache, meta, cos_sin_cache)
        x, h = self.post_attention_layernorm.add_and_norm(a, h)
        return self.mlp(x, getattr(meta, "lora_mapping", None)).add_(h)


class CausalLM(nn.Module):
    """A decoder-only LM whose attention reads and writes the paged KV cache through ``backend``.

    The engine sets ``kv_caches`` (one opaque object per layer, from ``backend.allocate_kv_cache``) before
    ``forward``. ``forward`` returns final-normed hidden states; ``compute_logits`` projects the rows it is given.
    """

    def __init__(self, config: Any, spec: ArchSpec, backend: Any):
        super().__init__()
        self.config = config
        self.spec = spec
        self.num_layers: int = config.num_hidden_layers
        self.num_heads: int = config.num_attention_heads
        # What one token's cache entry holds (MLA: one latent row, KVCacheSpec.mla).
        self.num_kv_heads, self.head_size, self.kv_cache_mla = kv_cache_shape(config, spec)
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = config.max_position_embeddings
        self.layer_sliding_windows = layer_sliding_windows(config, spec)
        # One window for the whole model only when every layer slides: then old blocks are dead for all layers.
        windows = set(self.layer_sliding_windows)
        self.sliding_window: Optional[int] = windows.pop() if len(windows) == 1 else None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.eos_token_ids: list[int] = []
        self.kv_caches: list = []

        # Given a weight, nn.Embedding skips its random init: on the meta device that init pulls in torch._dynamo
        # (0.6-4 s of a cold start) for values the checkpoint overwrites anyway.
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, spec, backend, w, i)
                                    for i, w in enumerate(self.layer_sliding_windows))
        self.supports_lora = spec.moe == "none" and not spec.gemma and spec.attention == "mha"  # LoRA parity is tested on the others
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.rms_norm, spec.gemma)
        self.embed_scale: Optional[float] = config.hidden_size ** 0.5 if spec.gemma else None
        self.final_logit_softcapping: Optional[float] = getattr(config, "final_logit_softcapping", None)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_gather: Any = None  # tensor parallel: the vocab-parallel LM head's all-gather
        self.start_layer, self.end_layer = 0, self.num_layers  # pipeline parallel: this stage's layers
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        # (apply, state) of the backend's dense kernel over a packed copy of lm_head_weight, or of its kernel for a
        # tied GGUF embedding's own blocks (models/dense_linears.py)
        self.lm_head_kernel: Optional[tuple] = None
        # Gemma 3: per layer type rotary tables (set by the loader), else every layer reads cos_sin_cache.
        self.rope_caches: dict[str, torch.Tensor] = {}
        self.layer_types: list[str] = list(getattr(config, "layer_types", None)
                                           or ["full_attention"] * self.num_layers)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        e = self.embed_tokens
        return e.dtype if isinstance(e, QuantizedEmbedding) else e.weight.dtype

    @property
    def device(self) -> torch.device:
        e = self.embed_tokens
        return e.device if isinstance(e, QuantizedEmbedding) else e.weight.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The dense LM head; a tied GGUF-packed embedding is dequantized here (the loader reads it once, to build
        ``lm_head_kernel``)."""
        if not self.tie_word_embeddings:
            return self.lm_head.weight
        e = self.embed_tokens
        return torch.cat(list(e.dequantize(e.dtype))) if isinstance(e, QuantizedEmbedding) else e.weight

    def lora_site_split(self, layer: int, site: str) -> tuple[int, list[int]]:
        """(in features, out features of each fused sub-projection) of a LoRA site of ``layer``."""
        attn, mlp = self.layers[layer].self_attn, self.layers[layer].mlp
        if site == "qkv_proj":
            return self.hidden_size, list(attn.split_sizes)
        if site == "o_proj":
            return attn.o_proj.in_features, [self.hidden_size]
        if site == "gate_up_proj":
            half = mlp.gate_up_proj.out_features // 2
            return self.hidden_size, [half, half]
        if site == "down_proj":
            return mlp.down_proj.in_features, [self.hidden_size]
        raise ValueError(f"unknown LoRA site {site!r}")

    def set_lora_buffers(self, buffers: list[dict]) -> None:
        """Point every layer's LoRA sites at the manager's per-layer ``{site: (A, B)}`` slot stacks."""
        for layer, bufs in zip(self.layers, buffers, strict=True):
            layer.self_attn.lora_qkv, layer.self_attn.lora_o = bufs["qkv_proj"], bufs["o_proj"]
            layer.mlp.lora_gate_up, layer.mlp.lora_down = bufs["gate_up_proj"], bufs["down_proj"]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden_size]``. A pipeline stage
        runs its layers only: from the previous stage's ``hidden`` (not the embedding) and, except on the last
        stage, without the final norm."""
        if hidden is None:
            h = self.embed_tokens(input_ids)
            if self.embed_scale is not None:  # HF casts the scale to the weights' dtype first
                h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        else:
            h = hidden
        if len(self.kv_caches) != self.end_layer - self.start_layer:
            raise RuntimeError(f"{len(self.kv_caches)} KV caches for {self.end_layer - self.start_layer} layers")
        for i in range(self.start_layer, self.end_layer):
            cos_sin = self.rope_caches[self.layer_types[i]] if self.rope_caches else self.cos_sin_cache
            h = self.layers[i](h, positions, self.kv_caches[i - self.start_layer], meta, cos_sin)
        return self.norm(h) if self.end_layer == len(self.layers) else h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` in the model's dtype (Gemma 2: final soft-capping)."""
        if self.lm_head_kernel is not None:
            apply, state = self.lm_head_kernel
            logits = apply(state, hidden, None)
        else:
            logits = F.linear(hidden, self.lm_head_weight)
        if self.logits_gather is not None:  # vocab-parallel LM head: every rank's slice of the vocabulary
            logits = self.logits_gather(logits)
        if self.final_logit_softcapping is not None:
            c = self.final_logit_softcapping
            logits = torch.tanh(logits / c) * c
        return logits
