"""A one-layer decoder wired through a backend's ops: the call pattern of the engine's models, small enough to run
under the Triton interpreter. The graph check feeds it to the backend's graph runner."""

from __future__ import annotations

import torch

from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.registry import Backend


class TinyDecoder(torch.nn.Module):
    """``model(input_ids, positions, meta) -> hidden_states``; weights from ``gen``, KV in a persistent cache. An
    ``nn.Module`` like the engine's models, so graph runners may hook or walk it."""

    def __init__(self, backend: Backend, kv_cache, *, vocab: int, num_heads: int, num_kv_heads: int, head_size: int,
                 dtype: torch.dtype, device: torch.device, gen: torch.Generator, max_pos: int = 256):
        super().__init__()
        self.be, self.kv_cache = backend, kv_cache
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_size
        hidden, inter = num_heads * head_size, 2 * num_heads * head_size

        def w(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) / shape[0] ** 0.5).to(device=device, dtype=dtype)

        self.embed = (torch.randn(vocab, hidden, generator=gen)).to(device=device, dtype=dtype)
        self.wqkv = w(hidden, (num_heads + 2 * num_kv_heads) * head_size)
        self.wo, self.wgu, self.wdown = w(hidden, hidden), w(hidden, 2 * inter), w(inter, hidden)
        self.n1 = torch.ones(hidden, dtype=dtype, device=device)
        self.n2 = torch.ones(hidden, dtype=dtype, device=device)
        inv = 1.0 / (10000 ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        f = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        self.cos_sin = torch.cat((f.cos(), f.sin()), dim=-1).to(device=device, dtype=dtype)
        self.max_model_len = max_pos

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        be, t = self.be, input_ids.shape[0]
        h = self.embed[input_ids]
        x = be.rms_norm(h, self.n1, 1e-6)
        q, k, v = (x @ self.wqkv).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k = be.rotary(positions, q.reshape(t, self.h, self.d), k.reshape(t, self.hkv, self.d), self.cos_sin)
        v = v.reshape(t, self.hkv, self.d)
        be.write_kv(k, v, self.kv_cache, meta.slot_mapping, 1.0, 1.0)
        a = be.paged_attention(q, self.kv_cache, meta, self.d ** -0.5, None, None, 1.0, 1.0)
        h = h + a.reshape(t, -1) @ self.wo
        x = be.rms_norm(h, self.n2, 1e-6)
        return h + be.silu_and_mul(x @ self.wgu) @ self.wdown
