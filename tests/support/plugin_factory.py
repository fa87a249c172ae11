"""Build small in-process backend plugins for tests: the required hooks plus whatever op hooks a test passes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Callable, Optional

import torch

from pagedllm.backend.hookspec import (BackendInfo, Capabilities, KVCacheConfig, MambaSpec, MemoryInfo, ProbeResult,
                                      hookimpl)


#: What core's reference ops run: a plugin that leaves attention and MLA to them states these features.
REFERENCE_FEATURES = dict(sliding_window=True, soft_cap=True, mla=True)


def make_plugin(name: str, caps: Capabilities = Capabilities(**REFERENCE_FEATURES), device_name: str = "cpu",
                **ops) -> SimpleNamespace:
    """A CPU backend plugin: required hooks, ``caps``, and ``ops`` as ``pagedllm_<key>`` hooks (others fall back
    to core's reference ops)."""
    @hookimpl
    def pagedllm_backend_info():
        return BackendInfo(name=name, device_type="cpu")

    @hookimpl
    def pagedllm_probe():
        return ProbeResult(True, device_name=device_name)

    @hookimpl
    def pagedllm_capabilities():
        return caps

    @hookimpl
    def pagedllm_memory_info(device):
        return MemoryInfo(total_bytes=8 << 30, free_bytes=4 << 30)

    hooks = {f"pagedllm_{k}": hookimpl(v) for k, v in ops.items()}
    return SimpleNamespace(pagedllm_backend_info=pagedllm_backend_info, pagedllm_probe=pagedllm_probe,
                           pagedllm_capabilities=pagedllm_capabilities, pagedllm_memory_info=pagedllm_memory_info,
                           **hooks)


def write_plugin_package(root, dist: str, module: str, source: str, entry_name: str) -> str:
    """Write an installed-looking backend package under ``root`` (a directory to put on ``sys.path`` /
    ``PYTHONPATH``): ``<module>/__init__.py`` holding ``source`` and ``<dist>-0.0.1.dist-info`` whose entry point
    publishes it in the ``pagedllm.backends`` group, so discovery finds it exactly as it finds a pip-installed vendor
    package, without pip. Returns ``root`` as a string."""
    import os

    os.makedirs(os.path.join(root, module), exist_ok=True)
    with open(os.path.join(root, module, "__init__.py"), "w") as f:
        f.write(source)
    info = os.path.join(root, f"{dist.replace('-', '_')}-0.0.1.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write(f"[pagedllm.backends]\n{entry_name} = {module}\n")
    return str(root)


#: A backend as a vendor wrote it against contract v1 (before v2 existed), declaring the oldest contract version core
#: still loads (``API_VERSION - 1``: v1 plugins themselves are refused since contract v3): the v1 module path
#: (``pagedllm.hookspec``), v1 hook signatures (no fp8 scales, no ALiBi, a graph runner without ``ctx``), the v1
#: ``copy_kv_blocks`` hook, its own blocks-first KV layout ``[num_blocks, 2, block_size, heads, head_size]`` with
#: its own write, attention, gather and swap, and no host-cache allocator (v1 had none). ``BLOCK_OFFSET_BUG = 1``
#: makes its attention look up position p's block at table index ``(p + 1) // block_size``: wrong only for the
#: last slot of each block.
V1_BACKEND = '''
"""NAME: a pagedllm backend written against contract v1."""
import torch
from pagedllm.hookspec import (API_VERSION, BackendInfo, Capabilities, GraphRunner, MemoryInfo, ProbeResult,
                               hookimpl)

BLOCK_OFFSET_BUG = BUG


@hookimpl
def pagedllm_backend_info():
    return BackendInfo(name="NAME", device_type="cpu", priority=-1, api_version=API_VERSION - 1,
                       description="a v1-era backend")


@hookimpl
def pagedllm_probe():
    return ProbeResult(True, device_name="host CPU")


@hookimpl
def pagedllm_capabilities():
    return Capabilities(dtypes=("float32", "bfloat16"), head_sizes=(64,), block_sizes=(16, 32), sliding_window=True,
                        soft_cap=True)


@hookimpl
def pagedllm_memory_info(device):
    return MemoryInfo(total_bytes=2 << 30, free_bytes=1 << 30, default_kv_bytes=32 << 20)


@hookimpl
def pagedllm_allocate_kv_cache(spec):
    return [torch.zeros(spec.num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size, dtype=spec.dtype,
                        device=spec.device) for _ in range(spec.num_layers)]


@hookimpl
def pagedllm_write_kv(key, value, kv_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bs = kv_cache.shape[2]
    kv_cache[slots // bs, 0, slots % bs] = key[keep].to(kv_cache.dtype)
    kv_cache[slots // bs, 1, slots % bs] = value[keep].to(kv_cache.dtype)


@hookimpl
def pagedllm_paged_attention(query, kv_cache, meta, scale, sliding_window, soft_cap):
    bs, hkv = kv_cache.shape[2], kv_cache.shape[3]
    group = query.shape[1] // hkv
    out = torch.zeros_like(query)
    qsl, tables = meta.query_start_loc_cpu, meta.block_tables.cpu()
    for i, s in enumerate(meta.seq_lens_cpu):
        start, end = qsl[i], qsl[i + 1]
        if end == start:
            continue
        pos = torch.arange(s)
        idx = ((pos + BLOCK_OFFSET_BUG) // bs).clamp(max=tables.shape[1] - 1)
        blocks = tables[i, idx].long().to(kv_cache.device)
        offs = (pos % bs).to(kv_cache.device)
        k = kv_cache[blocks, 0, offs].float().repeat_interleave(group, 1)
        v = kv_cache[blocks, 1, offs].float().repeat_interleave(group, 1)
        scores = torch.einsum("lhd,shd->hls", query[start:end].float(), k) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        q_pos = torch.arange(s - (end - start), s)[:, None]
        keep = pos[None, :] <= q_pos
        if sliding_window:
            keep &= q_pos - pos[None, :] < sliding_window
        scores = scores.masked_fill(~keep.to(scores.device)[None], float("-inf"))
        v = v.masked_fill(~keep.any(0).to(v.device)[:, None, None], 0.0)  # a freed window block may hold NaN
        out[start:end] = torch.einsum("hls,shd->lhd", scores.softmax(-1), v).to(query.dtype)
    return out


@hookimpl
def pagedllm_gather_kv_blocks(kv_cache, block_ids):
    return kv_cache[block_ids.to(kv_cache.device)].transpose(0, 1).contiguous()


@hookimpl
def pagedllm_copy_kv_blocks(kv_caches, src, dst):
    for c in kv_caches:
        c[dst] = c[src]


@hookimpl
def pagedllm_swap_kv_blocks(src_caches, dst_caches, src, dst):
    for s, d in zip(src_caches, dst_caches):
        d[dst.to(d.device)] = s[src.to(s.device)].to(d.device)


@hookimpl
def pagedllm_graph_runner(model, max_num_seqs, device):
    return GraphRunner(run=model, level="none")
'''


def v1_backend_source(name: str, block_offset_bug: bool = False) -> str:
    return V1_BACKEND.replace("NAME", name).replace("= BUG", f"= {int(block_offset_bug)}")


def per_layer_allocator(seen: Optional[list] = None, alias: tuple[int, ...] = ()) -> Callable[[KVCacheConfig], dict]:
    """A backend's ``pagedllm_allocate_kv_cache_groups``: a distinct canonical tensor per paged layer (core's sharing
    across sliding-window groups ignored: allowed) and its own state tensors; the layers of ``alias`` all get the
    first one's tensor (a broken backend); ``seen`` collects (config, caches) per call."""
    def allocate(config: KVCacheConfig) -> dict:
        caches: dict = {}
        if seen is not None:
            seen.append((config, caches))
        for group in config.kv_cache_groups:
            spec = group.kv_cache_spec
            for layer in group.layer_ids:
                if isinstance(spec, MambaSpec):
                    caches[layer] = tuple(torch.zeros((spec.num_slots, *shape), dtype=dtype, device=spec.device)
                                          for shape, dtype in zip(spec.shapes, spec.dtypes))
                else:
                    caches[layer] = torch.zeros(spec.canonical_shape(config.num_blocks), dtype=spec.dtype,
                                                device=config.device)
        for layer in alias[1:]:
            caches[layer] = caches[alias[0]]
        return caches
    return allocate
