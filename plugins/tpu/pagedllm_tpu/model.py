"""The Llama family (Llama, Mistral, Qwen2, Qwen3) as a pure JAX function over a parameter pytree.

Mirrors core's ``pagedllm.models.causal_lm.CausalLM`` op for op (RMSNorm in float32 then cast, q/k/v and gate/up
projections — core's fused weights split at load so each can be sharded by heads —, optional q/k norm, neox rotary from core's ``cos_sin_cache``, per-layer sliding windows, GQA, SwiGLU) so
the weights come straight from the torch model core already loaded — safetensors or GGUF, every rope scaling core
handles — and nothing is re-parsed. Layers are unrolled in Python (each may have its own window); the KV arrays are
threaded through and returned updated, so the caller can donate them (tpu-inference's model functions take and return
``kv_caches`` the same way: ``tpu_inference/runner/tpu_runner.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from pagedllm_tpu import kv_cache as kvc
from pagedllm_tpu import mesh
from pagedllm_tpu.attention import ragged_paged_attention


@dataclass(frozen=True)
class ModelSpec:
    """The static (hashable) shape of the model; closed over by ``jax.jit``."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    eps: float
    windows: tuple
    soft_cap: Optional[float]
    qk_norm: bool
    exact_matmul: bool  # float32 models: HIGHEST matmul precision (TPU's default f32 matmul uses bf16 passes)


def _np(t: torch.Tensor, dtype: Any) -> np.ndarray:
    return t.detach().cpu().float().numpy().astype(dtype)


def params_from_torch(model: Any, dtype: torch.dtype) -> tuple[ModelSpec, dict]:
    """(spec, params placed on the backend's mesh) from a loaded ``CausalLM``; linear weights stored ``[in, out]``,
    q/k/v and gate/up unfused so each can be split by heads / columns (:mod:`pagedllm_tpu.mesh`)."""
    jd = kvc.jax_dtype(dtype)
    sd = model.state_dict()

    def w(name: str, transpose: bool = False) -> np.ndarray:
        t = sd[name]
        return _np(t.t() if transpose else t, jd)

    q_size, kv_size = model.num_heads * model.head_size, model.num_kv_heads * model.head_size
    inter = model.layers[0].mlp.down_proj.in_features
    mesh.check_divisible(model.num_heads, model.num_kv_heads, inter)

    def split(x: np.ndarray, sizes: list[int], prefix: str, suffix: str) -> dict:
        """Core fuses q/k/v and gate/up along the output dim; unfused, each shards by whole heads / columns."""
        parts = np.split(x, np.cumsum(sizes)[:-1], axis=-1)
        return {f"{n}_{suffix}": part for n, part in zip(prefix.split(","), parts)}

    layers = []
    for i in range(model.num_layers):
        p = f"layers.{i}."
        layer = {"in_norm": w(p + "input_layernorm.weight"), "post_norm": w(p + "post_attention_layernorm.weight"),
                 "o_w": w(p + "self_attn.o_proj.weight", True), "down_w": w(p + "mlp.down_proj.weight", True)}
        layer.update(split(w(p + "self_attn.qkv_proj.weight", True), [q_size, kv_size, kv_size], "q,k,v", "w"))
        layer.update(split(w(p + "mlp.gate_up_proj.weight", True), [inter, inter], "gate,up", "w"))
        if p + "self_attn.qkv_proj.bias" in sd:
            layer.update(split(w(p + "self_attn.qkv_proj.bias"), [q_size, kv_size, kv_size], "q,k,v", "b"))
        if p + "mlp.gate_up_proj.bias" in sd:
            layer.update(split(w(p + "mlp.gate_up_proj.bias"), [inter, inter], "gate,up", "b"))
        for key, name in (("o_b", "self_attn.o_proj.bias"), ("down_b", "mlp.down_proj.bias"),
                          ("q_norm", "self_attn.q_norm.weight"), ("k_norm", "self_attn.k_norm.weight")):
            if p + name in sd:
                layer[key] = w(p + name)
        layers.append(layer)
    params = {"embed": w("embed_tokens.weight"), "layers": layers, "norm": w("norm.weight"),
              "lm_head_t": _np(model.lm_head_weight.t(), jd),
              "cos_sin": model.cos_sin_cache.detach().cpu().float().numpy()}
    spec = ModelSpec(model.num_layers, model.num_heads, model.num_kv_heads, model.head_size,
                     float(model.config.rms_norm_eps), tuple(model.layer_sliding_windows),
                     getattr(model.config, "attn_logit_softcapping", None), "q_norm" in layers[0],
                     dtype == torch.float32)
    return spec, mesh.shard_params(params)


# ---- ops (jnp twins of core's reference ops) -------------------------------------------------------------------------
def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""
    import jax
    import jax.numpy as jnp

    h = x.astype(jnp.float32)
    h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + eps)
    return weight * h.astype(x.dtype)


def rotary(positions: Any, query: Any, key: Any, cos_sin: Any) -> tuple[Any, Any]:
    """Neox rotary over the first ``rot_dim`` features; ``cos_sin[p] = cat(cos, sin)`` (core's cache)."""
    import jax.numpy as jnp

    cs = cos_sin[positions]
    half = cs.shape[-1] // 2
    rot = cs.shape[-1]
    cos = jnp.concatenate([cs[:, :half], cs[:, :half]], axis=-1)[:, None, :]
    sin = jnp.concatenate([cs[:, half:], cs[:, half:]], axis=-1)[:, None, :]

    def apply(x: Any) -> Any:
        xr, xp = x[..., :rot], x[..., rot:]
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        y = xr * cos.astype(x.dtype) + jnp.concatenate([-x2, x1], axis=-1) * sin.astype(x.dtype)
        return jnp.concatenate([y, xp], axis=-1) if xp.shape[-1] else y

    return apply(query), apply(key)


def silu_and_mul(x: Any) -> Any:
    import jax

    d = x.shape[-1] // 2
    return jax.nn.silu(x[..., :d]) * x[..., d:]


def _linear(spec: ModelSpec, x: Any, w: Any, b: Any = None) -> Any:
    import jax
    import jax.numpy as jnp

    prec = jax.lax.Precision.HIGHEST if spec.exact_matmul else None
    y = jnp.matmul(x, w, precision=prec)
    return y + b if b is not None else y


# ---- the forward --------------------------------------------------------------------------------------------------
def forward(spec: ModelSpec, params: dict, kv: list, input_ids: Any, positions: Any, slot_mapping: Any,
            cu_q_lens: Any, kv_lens: Any, page_indices: Any) -> tuple[Any, list]:
    """Flat ragged batch -> (final-normed hidden ``[T, hidden]``, updated KV arrays)."""
    import jax

    t = input_ids.shape[0]
    nh, nkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_size
    h = params["embed"][input_ids]
    new_kv = []
    for i, layer in enumerate(params["layers"]):
        x = rms_norm(h, layer["in_norm"], spec.eps)
        q = _linear(spec, x, layer["q_w"], layer.get("q_b")).reshape(t, nh, hd)
        k = _linear(spec, x, layer["k_w"], layer.get("k_b")).reshape(t, nkv, hd)
        v = _linear(spec, x, layer["v_w"], layer.get("v_b")).reshape(t, nkv, hd)
        if spec.qk_norm:
            q, k = rms_norm(q, layer["q_norm"], spec.eps), rms_norm(k, layer["k_norm"], spec.eps)
        q, k = rotary(positions, q, k, params["cos_sin"])
        cache = kvc.write_kv(kv[i], k, v, slot_mapping)
        new_kv.append(cache)
        attn = ragged_paged_attention(q, cache, kv_lens, page_indices, cu_q_lens, sm_scale=hd ** -0.5,
                                      sliding_window=spec.windows[i], soft_cap=spec.soft_cap)
        h = _linear(spec, attn.reshape(t, nh * hd), layer["o_w"], layer.get("o_b")) + h
        x = rms_norm(h, layer["post_norm"], spec.eps)
        gate = _linear(spec, x, layer["gate_w"], layer.get("gate_b"))
        up = _linear(spec, x, layer["up_w"], layer.get("up_b"))
        h = _linear(spec, jax.nn.silu(gate) * up, layer["down_w"], layer.get("down_b")) + h
    return rms_norm(h, params["norm"], spec.eps), new_kv


def compute_logits(spec: ModelSpec, params: dict, hidden: Any) -> Any:
    """``[N, hidden]`` -> float32 ``[N, vocab]`` (the projection in the model dtype, as core's ``compute_logits``)."""
    import jax.numpy as jnp

    return _linear(spec, hidden, params["lm_head_t"]).astype(jnp.float32)
