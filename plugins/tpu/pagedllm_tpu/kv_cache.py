"""The paged KV cache as JAX arrays, in the layout of tpu-inference's ragged paged attention.

One array per layer, ``[num_pages, page_size, 2 * num_kv_heads, head_size]``: keys and values of a KV head sit side
by side on the head axis (K of head h at ``2h``, V at ``2h + 1``), so one page fetch brings both — tpu-inference's
"combined KV heads" (``kv_pages [total_num_pages, page_size, num_combined_kv_heads, head_dim]`` in
vllm-project/tpu-inference ``tpu_inference/kernels/ragged_paged_attention/v2/kernel.py``; ``merge_kv`` in ``v3/kernel.py``
builds it by ``concat([k, v], -1).reshape(T, 2 * Hkv, D)``). The v3 Pallas kernel further pads the head axis to the
dtype's packing and ``head_dim`` to 128 lanes; that padding only serves the TPU kernel's tiling and is not applied by
the jnp path here.

JAX arrays are immutable, while core's cache objects are written in place (``write_kv``,
``swap_kv_blocks``). Each layer's cache is therefore a :class:`JaxKVCache` holder whose ``array`` is replaced by the
updated array (the jitted step donates the old buffer, so the update is in place on the device). The torch bridges
below serve core's tensor-level hooks (conformance, swap); the model runner never leaves JAX.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class JaxKVCache:
    """One layer's KV pages: a mutable handle on an immutable ``jax.Array``."""

    __slots__ = ("array",)

    def __init__(self, array: Any):
        self.array = array

    @property
    def shape(self) -> tuple:
        return tuple(self.array.shape)

    @property
    def dtype(self) -> Any:
        return self.array.dtype

    @property
    def nbytes(self) -> int:
        return int(self.array.size) * self.array.dtype.itemsize

    def __repr__(self) -> str:
        return f"JaxKVCache(shape={self.shape}, dtype={self.dtype})"


def cache_shape(num_pages: int, page_size: int, num_kv_heads: int, head_size: int) -> tuple[int, int, int, int]:
    return (num_pages, page_size, 2 * num_kv_heads, head_size)


def jax_dtype(dtype: torch.dtype) -> Any:
    import jax.numpy as jnp

    return {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}[dtype]


# ---- pure functions, traced inside jit ----------------------------------------------------------------------------
def merge_kv(key: Any, value: Any) -> Any:
    """``[T, Hkv, D]`` keys and values -> ``[T, 2 * Hkv, D]`` with K/V of each head interleaved."""
    import jax.numpy as jnp

    t, h, d = key.shape
    return jnp.concatenate([key, value], axis=-1).reshape(t, 2 * h, d)


def write_kv(cache: Any, key: Any, value: Any, slot_mapping: Any) -> Any:
    """Scatter new K/V to flat slots ``page * page_size + offset``; a negative slot writes nothing. Static padding
    writes to the sink page instead (core's pad slot), so every step's scatter has the bucket's shape."""
    import jax.numpy as jnp

    n, p, h2, d = cache.shape
    flat = cache.reshape(n * p, h2, d)
    # jnp wraps negative indices; send them out of bounds, where mode="drop" discards them.
    slots = jnp.where(slot_mapping < 0, n * p, slot_mapping)
    kv = merge_kv(key, value).astype(cache.dtype)
    return flat.at[slots].set(kv, mode="drop").reshape(n, p, h2, d)


def split_kv(pages: Any) -> tuple[Any, Any]:
    """``[..., 2 * Hkv, D]`` -> keys and values ``[..., Hkv, D]``."""
    return pages[..., 0::2, :], pages[..., 1::2, :]


# ---- host bridges (torch <-> jax) -----------------------------------------------------------------------------------
def to_jax(t: torch.Tensor, dtype: Any = None) -> Any:
    """A torch tensor on the backend's JAX device (through numpy; bf16 goes through float32, exactly)."""
    import jax

    from pagedllm_tpu import mesh

    t = t.detach().cpu()
    arr = (t.float() if t.dtype in (torch.bfloat16, torch.float16) else t).numpy()
    if dtype is not None:
        arr = arr.astype(dtype)
    elif t.dtype == torch.bfloat16:
        import jax.numpy as jnp

        arr = arr.astype(jnp.bfloat16)
    elif t.dtype == torch.float16:
        arr = arr.astype(np.float16)
    return jax.device_put(arr, mesh.replicated())


def to_torch(a: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    arr = np.asarray(a)
    if arr.dtype.name == "bfloat16":
        out = torch.from_numpy(arr.astype(np.float32)).to(torch.bfloat16)
    else:
        out = torch.from_numpy(np.array(arr))
    return out.to(dtype) if dtype is not None else out


def pad_pow2(*index_lists: np.ndarray) -> list[np.ndarray]:
    """Pad index vectors to the next power of two by repeating their last entry (a repeated copy is idempotent), so
    block gathers and scatters compile once per power of two, not once per count."""
    n = len(index_lists[0])
    m = 1 << max(0, (n - 1).bit_length())
    return [np.concatenate([x, np.repeat(x[-1:], m - n)]).astype(np.int32) for x in index_lists]


_jitted: dict[str, Any] = {}


def block_program(name: str) -> Any:
    """Block gather/scatter programs, jitted once per process (the cache argument donated where updated)."""
    if not _jitted:
        import jax

        from pagedllm_tpu import mesh

        kv = mesh.kv_sharding()  # updated caches keep the step's sharding (else the step would see a new signature)
        _jitted["gather"] = jax.jit(lambda cache, ids: cache[ids], out_shardings=mesh.replicated())
        _jitted["scatter"] = jax.jit(lambda cache, dst, blocks: cache.at[dst].set(blocks.astype(cache.dtype)),
                                     donate_argnums=0, out_shardings=kv)
    return _jitted[name]


def gather_blocks(cache: JaxKVCache, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks in canonical layout ``[2, n, page_size, Hkv, D]`` (conformance and debugging read-back)."""
    ids = block_ids.detach().cpu().numpy().astype(np.int32)
    if ids.size == 0:
        n, p, h2, d = cache.shape
        return to_torch(np.zeros((2, 0, p, h2 // 2, d), cache.dtype))
    (padded,) = pad_pow2(ids)
    pages = np.asarray(block_program("gather")(cache.array, padded))[: len(ids)]
    k, v = split_kv(pages)
    return to_torch(np.stack([k, v]))


def swap_blocks(src_caches: list, dst_caches: list, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Device (:class:`JaxKVCache`) <-> host (numpy arrays in the same layout), either direction."""
    s = src.detach().cpu().numpy().astype(np.int32)
    d = dst.detach().cpu().numpy().astype(np.int32)
    for a, b in zip(src_caches, dst_caches):
        if isinstance(a, JaxKVCache):  # swap out: device pages -> host
            (ps,) = pad_pow2(s)
            b[d] = np.asarray(block_program("gather")(a.array, ps))[: len(s)]
        else:  # swap in: host pages -> device
            pd, ps = pad_pow2(d, s)
            b.array = block_program("scatter")(b.array, pd, np.asarray(a)[ps])
