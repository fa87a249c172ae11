"""What keeps a packed GGUF model's resident memory small (docs/benchmarks.md, issue 12), asserted structurally:
the token embedding stays the file's Q8_0 blocks in the file's mapping, the file's pages are unmapped once copied,
KV cache pages are committed on first write, and freed empty blocks are reused before unwritten ones."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import torch

from pagedllm.backend.registry import get_backend
from pagedllm.sched.kv_manager import BlockPool, KVCacheManager
from pagedllm.models import load_model, resolve_model_path
from pagedllm.models.gguf_weights import read_tensors
from pagedllm.models.quantized_embedding import QuantizedEmbedding
from int8_act import use_int8_activations

MiB = 1 << 20


def _mapped_rss(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, current = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                current = parts[5] if len(parts) > 5 else None
            elif parts[0] == "Rss:" and current == path:
                total += int(parts[1]) * 1024
    return total


def _smollm2(backend, quantization):
    return load_model(resolve_model_path(None), backend=backend, dtype=torch.float32, device=torch.device("cpu"),
                      quantization=quantization)


def test_smollm2_embedding_is_the_files_q8_0_blocks_and_the_file_is_unmapped(monkeypatch):
    from pagedllm_cpu import native

    use_int8_activations(monkeypatch, False)  # the head's fp32 kernel, held to fp32 tolerance below (a decode's int8
    # activations: test_int8_act_gemv.py)

    assert native.get(wait=True, timeout=600) is not None, native.error()  # the Q8_0 head kernel is in the library
    path = resolve_model_path(None)
    model = _smollm2(get_backend("cpu"), "gguf")
    mapped = _mapped_rss(path)  # no page of the 98 MB file stays resident once loaded (before this test reads it)
    emb = model.embed_tokens
    token_embd = next(t for t in read_tensors(path)[1] if t.name == "token_embd.weight")
    assert isinstance(emb, QuantizedEmbedding) and emb.weight_type.name == "Q8_0"
    # the file's bytes, not a copy: 612 bytes a row (18 blocks of 34), read-only, 29 MB where float32 was 113 MB
    assert emb.blocks.shape == (49152, 612) and not emb.blocks.flags.writeable
    assert np.array_equal(emb.blocks[[0, 7, 49151]], token_embd.data[[0, 7, 49151]])
    assert not any("embed_tokens" in k for k in model.state_dict())
    ids = torch.tensor([[0, 1, 17], [49151, 300, 1]])
    from gguf.quants import dequantize

    table = torch.from_numpy(dequantize(token_embd.data, token_embd.tensor_type))
    assert torch.equal(emb(ids), table[ids])  # exact: the rows dequantize as the whole table does
    head = model.lm_head_kernel[1]  # the tied LM head: the kernel reads the same blocks in place, no copy
    assert head.data_ptr() == emb.blocks.ctypes.data and head.shape == emb.blocks.shape
    x = torch.randn(2, 576, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(x).double(), x.double() @ table.double().T, rtol=1e-5,
                               atol=1e-4)
    assert mapped < 2 * MiB, mapped


def test_smollm2_packed_embedding_logits_equal_dense_on_reference(ref_backend):
    """No dense kernel (core's reference backend): the tied head is one dense copy for ``F.linear``; logits equal the
    file loaded fully dense, bit for bit."""
    ids = torch.tensor([1, 504, 3458, 314, 4649, 28, 17])
    outs = []
    for quantization in ("gguf", None):
        model = _smollm2(ref_backend, quantization)
        assert isinstance(model.embed_tokens, QuantizedEmbedding) == (quantization == "gguf")
        with torch.inference_mode():
            outs.append((model.embed_tokens(ids), model.compute_logits(model.embed_tokens(ids)[-3:])))
        del model
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


_KV_PAGES = """
import json, numpy as np, torch
from pagedllm.backend.registry import get_backend
from pagedllm.backend.hookspec import KVCacheSpec

def resident(t):  # resident bytes of t's own pages: /proc/self/pagemap's present bit
    first, last = t.data_ptr() // 4096, (t.data_ptr() + t.numel() * t.element_size() - 1) // 4096
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        return int((np.frombuffer(f.read((last - first + 1) * 8), np.uint64) >> np.uint64(63)).sum()) * 4096

cpu = get_backend("cpu")
(cache,) = cpu.allocate_kv_cache(KVCacheSpec(num_layers=1, num_blocks=2048, block_size=16, num_kv_heads=4,
                                             head_size=64, dtype=torch.float32, device=torch.device("cpu")))
out = [cache.numel() * cache.element_size(), resident(cache)]
cpu.write_kv(torch.ones(16, 4, 64), torch.ones(16, 4, 64), cache, torch.arange(16 * 500, 16 * 501), 1.0, 1.0)
out.append(resident(cache))
cache.fill_(1)
print(json.dumps(out + [resident(cache)]))
"""


def test_cpu_kv_cache_pages_are_committed_on_first_write():
    """64 MiB of cache is not resident until written; writing one block (2 x 16 KiB) commits about its pages. In a
    fresh interpreter: a long-lived one may serve the allocation from heap memory it already holds."""
    out = subprocess.run([sys.executable, "-c", _KV_PAGES], capture_output=True, text=True, check=True)
    size, allocated, written, filled = json.loads(out.stdout.strip().splitlines()[-1])
    assert size == 64 * MiB and filled >= size, (size, filled)
    assert allocated <= 64 * 1024 and written - allocated <= 64 * 1024, (allocated, written)


def test_freed_empty_blocks_are_reused_before_unwritten_ones():
    pool = BlockPool(8, enable_caching=True)
    a, b = pool.take(2)
    pool.register(a, b"h", (1,))
    pool.release([b, a])  # tail first: b (not cached) goes to the front, a (cached) to the back
    assert [blk.block_id for blk in pool.take(1)] == [b.block_id]
    kv = KVCacheManager(8, 16)
    blocks = kv.pool.take(3)
    for i, blk in enumerate(blocks):
        kv.pool.register(blk, bytes([i]), (i,))
    kv.pool.release(list(reversed(blocks)))
    assert kv.reset_prefix_cache()
    assert [blk.block_id for blk in kv.pool.take(3)] == [0, 1, 2]  # the written ones, not blocks 3..7
    assert kv.pool.num_cached == 0

