"""What the native families with recurrent state (LFM2, Qwen3-Next / 3.5, Mamba2, Granite-4.0-H) share: the model
interface around their layers (``StatefulCausalLM``) and the causal depthwise convolution every one of their mixers
runs over its state slot (``StateConv1d``).

The interface is ``CausalLM``'s (the engine, loader and backends read the same attributes) plus the state group:
``kv_caches`` holds the attention layers' paged caches (``num_layers``: the KV spec counts attention layers only),
``state_caches`` the state layers' tensors (``num_state_layers``, shapes ``state_shapes``, dtypes ``state_dtypes``),
indexed by ``AttentionMetadata.state_indices`` (contract v3: ``hookspec.MambaSpec``). Single rank, no LoRA. Without
state slots in the metadata (profiling and warm-up forwards) every state starts from zeros and keeps nothing.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.models.causal_lm import CausalLM


def token_embedding(config: Any) -> nn.Embedding:
    """The token embedding, given an empty weight: on the meta device nn.Embedding's random init pulls in
    torch._dynamo (0.6-4 s of a cold start) for values the checkpoint overwrites anyway."""
    return nn.Embedding(config.vocab_size, config.hidden_size,
                        _weight=torch.empty(config.vocab_size, config.hidden_size))


class StateConv1d(nn.Conv1d):
    """A causal depthwise convolution over ``width`` taps whose state (the last ``width - 1`` inputs of each
    sequence) is the request's slot in ``conv_states``: decode rows (first in the batch, one token each) through the
    backend's ``causal_conv1d_update``, prefill chunks through ``causal_conv1d_fn`` (continuing from the slot where
    ``has_initial_state``). Its parameters are ``nn.Conv1d``'s (the checkpoint's ``[dim, 1, width]``)."""

    def __init__(self, dim: int, width: int, bias: bool, backend: Any, activation: Optional[str]):
        super().__init__(dim, dim, width, groups=dim, bias=bias, padding=width - 1)
        self.activation = activation  # None or "silu"
        self.conv_fn, self.conv_update = backend.causal_conv1d_fn, backend.causal_conv1d_update

    def forward(self, x: torch.Tensor, conv_states: Optional[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """``x`` ``[T, dim]`` -> ``[T, dim]``; ``conv_states`` None: a fresh, throw-away state (profiling)."""
        weight, bias, act = self.weight.squeeze(1), self.bias, self.activation
        if conv_states is None:
            y = F.conv1d(x.t().unsqueeze(0), self.weight, bias, padding=self.padding,
                         groups=x.shape[1])[0, :, :x.shape[0]].t()
            return F.silu(y) if act == "silu" else y
        nd, qsl, idx = meta.num_decodes, meta.query_start_loc, meta.state_indices
        if nd == meta.num_seqs:
            return self.conv_update(x, conv_states, weight, bias, act, idx)
        if nd == 0:
            return self.conv_fn(x, weight, bias, conv_states, qsl, idx, meta.has_initial_state, act)
        y = torch.empty_like(x)
        y[:nd] = self.conv_update(x[:nd], conv_states, weight, bias, act, idx[:nd])
        y[nd:] = self.conv_fn(x[nd:], weight, bias, conv_states, qsl[nd:] - qsl[nd], idx[nd:],
                              meta.has_initial_state[nd:], act)
        return y


def layer_state(state: Optional[tuple], meta: AttentionMetadata) -> Optional[tuple]:
    """A state layer's tensors when this step carries state slots, else None (profiling and warm-up)."""
    return state if meta.state_indices is not None and state is not None else None


class StatefulCausalLM(nn.Module):
    """The model interface of a family with recurrent state; a subclass builds ``layers`` (each with
    ``is_attention``, called ``layer(h, positions, cache, meta, cos_sin_cache)``) and its final norm ``norm``, or
    overrides ``embed`` / ``final_norm``, and gives ``state_dtypes``."""

    supports_lora = False
    kv_cache_mla = False

    def __init__(self, config: Any, spec: Any, *, num_layers: int, num_state_layers: int,
                 state_shapes: tuple[tuple[int, ...], ...], tie_word_embeddings: bool = False,
                 kv_shape: Optional[tuple[int, int, int]] = None, max_model_len: Optional[int] = None,
                 embedding: bool = True):
        """``tie_word_embeddings``: the default when the config names none; ``kv_shape``: ``(num_heads,
        num_kv_heads, head_size)`` of a paged layer (default: the config's attention); ``embedding``: False where
        the subclass holds the embedding under the checkpoint's own name."""
        super().__init__()
        self.config, self.spec = config, spec
        self.num_layers: int = num_layers  # paged KV layers
        self.num_state_layers: int = num_state_layers
        self.state_shapes: tuple[tuple[int, ...], ...] = state_shapes
        if kv_shape is None:
            heads = config.num_attention_heads
            kv_shape = (heads, config.num_key_value_heads,
                        getattr(config, "head_dim", None) or config.hidden_size // heads)
        self.num_heads, self.num_kv_heads, self.head_size = kv_shape
        self.hidden_size: int = config.hidden_size
        self.vocab_size: int = config.vocab_size
        self.max_model_len: int = max_model_len or config.max_position_embeddings
        self.layer_sliding_windows: list[Optional[int]] = [None] * (num_layers + num_state_layers)
        self.sliding_window: Optional[int] = None
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", tie_word_embeddings))
        self.eos_token_ids: list[int] = []
        self.kv_caches: list = []
        self.state_caches: list = []
        if embedding:
            self.embed_tokens = token_embedding(config)
        if not self.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)
        self.lm_head_kernel: Optional[tuple] = None  # (apply, state) of a backend dense kernel, set by the loader
        self.rope_caches: dict[str, torch.Tensor] = {}

    # the same embedding/LM-head attributes as CausalLM, so the same accessors
    dtype, device, lm_head_weight = CausalLM.dtype, CausalLM.device, CausalLM.lm_head_weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden_size]``; each attention
        layer reads the next paged cache, each state layer the next state tensors."""
        h = self.embed(input_ids)
        kv, state = iter(self.kv_caches), iter(self.state_caches)
        for layer in self.layers:
            cache = next(kv) if layer.is_attention else next(state, None)
            h = layer(h, positions, cache, meta, self.cos_sin_cache)
        return self.final_norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden_size]`` -> ``[N, vocab_size]`` in the model's dtype."""
        if self.lm_head_kernel is not None:
            apply, state = self.lm_head_kernel
            return apply(state, hidden, None)
        return F.linear(hidden, self.lm_head_weight)
