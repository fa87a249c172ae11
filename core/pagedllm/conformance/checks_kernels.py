"""Kernel checks: each hook against ``pagedllm.backend.ref_ops`` on fresh random inputs, caches poisoned with NaN."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.backend import ref_ops
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.backend.registry import SwapUnsupported
from pagedllm.conformance.harness import (CaseContext, CheckFailed, NotApplicable, PagedBatch, Untested,
                                          cache_locator, canonical_cache, make_batch, poison, poison_allocator,
                                          slot_locator, token_locator)
from pagedllm.backend.hookspec import KVCacheSpec, QuantizedWeight
from pagedllm.backend.kv_quant import kv_torch_dtype
from pagedllm.lora.ops import LoRAMapping
from pagedllm.quantization import reference_kernel
from pagedllm.quantization.fp8 import random_fp8_weight
from pagedllm.quantization.gguf import random_blocks
from pagedllm.quantization.rtn import random_weight

NUM_KV_HEADS = 2


def kv_dtype(ctx: CaseContext) -> torch.dtype:
    """The case's cache dtype: its ``kv_cache_dtype`` param (fp8 cases), else the model dtype."""
    return kv_torch_dtype(ctx.params.get("kv_cache_dtype", "auto"), ctx.dtype)


def kv_scales(ctx: CaseContext) -> tuple[float, float]:
    return ctx.params.get("k_scale", 1.0), ctx.params.get("v_scale", 1.0)


def allocate(ctx: CaseContext, num_blocks: int, block_size: int, head_size: int, num_layers: int = 1) -> list:
    spec = KVCacheSpec(num_layers, num_blocks, block_size, NUM_KV_HEADS, head_size, kv_dtype(ctx), ctx.device)
    caches = ctx.backend.allocate_kv_cache(spec)
    for c in caches:
        if not poison(c):
            ctx.notes.append("cache is not made of float tensors: unwritten slots are not poisoned")
    return caches


def gather_all(ctx: CaseContext, cache, num_blocks: int) -> torch.Tensor:
    return ctx.backend.gather_kv_blocks(cache, torch.arange(num_blocks, device=ctx.device))


# ---- write_kv ---------------------------------------------------------------------------------------------------
def check_write_kv(ctx: CaseContext) -> None:
    hs, bs = ctx.params["head_size"], ctx.params["block_size"]
    nb, t = 5, 12
    slots = torch.tensor(ctx.randperm(nb * bs)[:t], dtype=torch.int64)
    slots[torch.tensor([2, 7, 11])] = -1  # padding tokens: must not be written
    slots = slots.to(ctx.device)
    key, value = ctx.randn(t, NUM_KV_HEADS, hs), ctx.randn(t, NUM_KV_HEADS, hs)
    (cache,) = allocate(ctx, nb, bs, hs)
    ctx.backend.write_kv(key, value, cache, slots, *kv_scales(ctx))
    ref = canonical_cache(nb, bs, NUM_KV_HEADS, hs, kv_dtype(ctx), ctx.device)
    ref_ops.write_kv(key, value, ref, slots, *kv_scales(ctx))
    ctx.compare(gather_all(ctx, cache, nb), ref, "cache after write_kv", exact=True,
                where=slot_locator(slots, bs))


# ---- paged attention ----------------------------------------------------------------------------------------------
def scenario_lengths(scenario: str, bs: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens), decodes first; lengths straddle block boundaries and span several key tiles."""
    if scenario == "decode":
        return [1, 1, 1, 1], [1, bs, bs + 1, 8 * bs + 5]
    if scenario == "prefill":
        return [3, bs + 5], [3, bs + 5]
    # mixed (also used for sliding window / soft cap): decodes, then chunks after cached context
    return [1, 1, 6, bs + 2], [bs - 1, 3 * bs + 2, bs + 9, 2 * bs + 2]


def fill_context(ctx: CaseContext, batch: PagedBatch, head_size: int) -> tuple[object, torch.Tensor, str]:
    """Every context token's K/V in the backend's cache and in a canonical reference cache. A canonical cache is
    filled by core's reference write, so an attention case checks attention alone (a write bug shows in the write_kv
    cases, not as every attention case failing); a cache of the backend's own layout can only be filled by its own
    write_kv. Returns the caches and which write filled the backend's."""
    n = batch.context_slots.shape[0]
    key, value = ctx.randn(n, NUM_KV_HEADS, head_size), ctx.randn(n, NUM_KV_HEADS, head_size)
    nb, bs = batch.num_blocks, batch.meta.block_size
    (cache,) = allocate(ctx, nb, bs, head_size)
    ref = canonical_cache(nb, bs, NUM_KV_HEADS, head_size, kv_dtype(ctx), ctx.device)
    ref_ops.write_kv(key, value, ref, batch.context_slots, *kv_scales(ctx))
    if isinstance(cache, torch.Tensor) and cache.is_contiguous() and cache.shape == ref.shape:
        ref_ops.write_kv(key, value, cache, batch.context_slots, *kv_scales(ctx))
        return cache, ref, "cache filled by core's reference write_kv (canonical layout)"
    ctx.backend.write_kv(key, value, cache, batch.context_slots, *kv_scales(ctx))
    return cache, ref, ("cache filled by the backend's own write_kv (its own layout): if write_kv cases fail, fix "
                        "those first")


def image_spans(meta: AttentionMetadata) -> list[list[tuple[int, int]]]:
    """PrefixLM image spans (``meta.mm_prefix_ranges``) inside each prefill chunk, as the scheduler keeps them: two
    spans in a long chunk (text around and between them), one covering a short chunk whole; none for decodes."""
    out = []
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        ql = meta.query_start_loc_cpu[i + 1] - meta.query_start_loc_cpu[i]
        lo = seq_len - ql
        if ql == 1:
            out.append([])
        elif ql < 6:
            out.append([(lo, seq_len)])
        else:
            mid = lo + 1 + (ql - 2) // 2
            out.append([(lo + 1, mid), (mid + 1, seq_len - 1)])
    return out


def check_attention(ctx: CaseContext) -> None:
    p = ctx.params
    hs, bs, heads = p["head_size"], p["block_size"], NUM_KV_HEADS * p["gqa"]
    batch = make_batch(ctx, *scenario_lengths(p["scenario"], bs), bs)
    if p.get("mm_prefix"):  # Gemma 3 with vision: bidirectional attention within each image span
        batch.meta.mm_prefix_ranges = image_spans(batch.meta)
    cache, ref_cache, filled = fill_context(ctx, batch, hs)
    ctx.notes.append(filled)
    query = ctx.randn(batch.meta.num_tokens, heads, hs, scale=p.get("query_scale", 1.0))
    scale = hs ** -0.5
    window, cap = p.get("sliding_window"), p.get("soft_cap")
    poison_allocator(query.numel(), ctx.dtype, ctx.device)
    alibi = {}
    if p.get("alibi"):  # the slopes of this head count (non-power-of-two heads take the interleaved extras)
        from pagedllm.models.alibi import alibi_slopes  # heavy: pagedllm.models, not at CLI start

        alibi = dict(alibi_slopes=alibi_slopes(heads).to(ctx.device))
    if p.get("sinks"):  # GPT-OSS sink logits: some heads' sinks dominate their scores, some are negligible
        alibi["sinks"] = ctx.randn(heads, dtype=torch.float32, scale=2.0)
    out = ctx.backend.paged_attention(query, cache, batch.meta, scale, window, cap, *kv_scales(ctx), **alibi)
    ref = ref_ops.paged_attention(query, ref_cache, batch.meta, scale, window, cap, *kv_scales(ctx), **alibi)
    try:
        ctx.compare(out, ref, "attention output", where=token_locator(batch.meta, hs))
    except CheckFailed as e:
        raise CheckFailed(f"{e} [{filled}]") from None


#: Sequence lengths of the encoder-attention batches: one sequence; several of different lengths (one token, one
#: over 64 rows); many short ones; a varlen batch followed by padding rows (static shapes pad the token count); and
#: a vision tower's images: CLIP ViT-L/14 at 336 px (577 rows: 24 x 24 patches + CLS) beside one at 224 px (257).
ENCODER_BATCHES = {"single": ([37], 0), "varlen": ([1, 17, 70, 5, 33], 0), "many_short": ([3, 8, 2, 6] * 4, 0),
                   "padded": ([9, 24, 4], 11), "images": ([577, 257, 577], 0)}


def check_encoder_attention(ctx: CaseContext) -> None:
    """Varlen, unpaged attention (``encoder_attention``) against the reference: bidirectional or causal, GQA, never
    across sequences; only the real rows are compared (padding rows may hold anything)."""
    p = ctx.params
    lens, pad = ENCODER_BATCHES[p["batch"]]
    hs, heads = p["head_size"], NUM_KV_HEADS * p["gqa"]
    cu = torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=ctx.device)
    t = sum(lens) + pad
    q, k, v = ctx.randn(t, heads, hs), ctx.randn(t, NUM_KV_HEADS, hs), ctx.randn(t, NUM_KV_HEADS, hs)
    scale = hs ** -0.5
    poison_allocator(q.numel(), ctx.dtype, ctx.device)
    out = ctx.backend.encoder_attention(q, k, v, cu, max(lens), scale, p["causal"])
    ref = ref_ops.encoder_attention(q, k, v, cu, max(lens), scale, p["causal"])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (t, heads, hs):
        raise CheckFailed(f"encoder_attention output: expected shape {(t, heads, hs)}, got "
                          f"{getattr(out, 'shape', type(out).__name__)}")
    bounds = cu.tolist()

    def where(idx: tuple) -> str:
        seq = int(np.searchsorted(bounds, idx[0], side="right")) - 1
        return f"sequence {seq} (length {lens[seq]}), row {idx[0] - bounds[seq]}, head {idx[1]}"

    ctx.compare(out[:sum(lens)], ref[:sum(lens)], "encoder_attention output", where=where)


def check_mla_attention(ctx: CaseContext) -> None:
    """MLA: latent rows written through ``write_mla_kv`` into an ``mla`` cache the backend allocated, then every
    query head attends to them (``mla_attention``) on a mixed batch, against the references."""
    latent, rope, heads, bs = ctx.params["kv_lora_rank"], ctx.params["rope"], ctx.params["heads"], ctx.params["block_size"]
    batch = make_batch(ctx, *scenario_lengths("mixed", bs), bs)
    rows = ctx.randn(batch.context_slots.shape[0], latent + rope)
    spec = KVCacheSpec(1, batch.num_blocks, bs, 1, latent + rope, ctx.dtype, ctx.device, mla=True)
    (cache,) = ctx.backend.allocate_kv_cache(spec)
    poison(cache)
    ctx.backend.write_mla_kv(rows, cache, batch.context_slots)
    ref = torch.full((1, batch.num_blocks, bs, 1, latent + rope), float("nan"), dtype=ctx.dtype, device=ctx.device)
    ref_ops.write_mla_kv(rows, ref, batch.context_slots)
    query = ctx.randn(batch.meta.num_tokens, heads, latent + rope)
    scale = (latent + rope) ** -0.5
    poison_allocator(query.numel(), ctx.dtype, ctx.device)
    ctx.compare(ctx.backend.mla_attention(query, cache, batch.meta, scale, latent),
                ref_ops.mla_attention(query, ref, batch.meta, scale, latent), "mla_attention output",
                where=token_locator(batch.meta, latent))


# ---- block gather and swap ------------------------------------------------------------------------------------------
def _filled(ctx: CaseContext, num_layers: int, nb: int, bs: int, hs: int) -> tuple[list, list]:
    """Backend caches and canonical references with every slot written except the last block's second half."""
    caches = allocate(ctx, nb, bs, hs, num_layers)
    refs = []
    slots = torch.arange(nb * bs - bs // 2, device=ctx.device)
    for cache in caches:
        key, value = ctx.randn(slots.numel(), NUM_KV_HEADS, hs), ctx.randn(slots.numel(), NUM_KV_HEADS, hs)
        ctx.backend.write_kv(key, value, cache, slots, *kv_scales(ctx))
        ref = canonical_cache(nb, bs, NUM_KV_HEADS, hs, kv_dtype(ctx), ctx.device)
        ref_ops.write_kv(key, value, ref, slots, *kv_scales(ctx))
        refs.append(ref)
    return caches, refs


def check_gather(ctx: CaseContext) -> None:
    hs, bs, nb = ctx.params["head_size"], ctx.params["block_size"], 5
    (cache,), (ref,) = _filled(ctx, 1, nb, bs, hs)
    ids = torch.tensor([4, 1, 3], device=ctx.device)
    ctx.compare(ctx.backend.gather_kv_blocks(cache, ids), ref_ops.gather_kv_blocks(ref, ids), "gathered blocks",
                exact=True, where=lambda idx: cache_locator(idx) + f" (gathered position {idx[1]} of blocks "
                                                                      f"{ids.tolist()})")


def check_swap(ctx: CaseContext) -> None:
    """Device -> host -> other device blocks round trip through host caches the backend allocates (its layout, any
    shape: one tensor or a tuple per layer); every other block must be left alone."""
    hs, bs, nb = ctx.params["head_size"], ctx.params["block_size"], 6
    caches, refs = _filled(ctx, 2, nb, bs, hs)
    if not all(_torch_tensors(c) for c in caches):
        raise Untested("the cache is not made of torch tensors: host copies cannot be checked")
    pin = ctx.device.type != "cpu" and ctx.backend.memory_info(ctx.device).pinned_host
    spec = KVCacheSpec(2, nb, bs, NUM_KV_HEADS, hs, kv_dtype(ctx), torch.device("cpu"))
    try:
        host = ctx.backend.allocate_host_kv_cache(spec, pin)
    except SwapUnsupported as e:  # core refuses swap for it and preempts by recompute: nothing to check
        raise NotApplicable(str(e)) from e
    if not ctx.backend.implements("pagedllm_allocate_host_kv_cache"):
        own = ctx.backend.implements("pagedllm_allocate_kv_cache")
        ctx.notes.append("host caches from core's fallback: " + ("the backend's own allocator on the host" if own
                                                                  else "the canonical reference allocator"))
    for h in host:
        poison(h)
    ref_host = [torch.full(r.shape, float("nan"), dtype=r.dtype) for r in refs]
    out_src, out_dst = torch.tensor([1, 5]), torch.tensor([3, 0])
    in_src, in_dst = torch.tensor([3, 0]), torch.tensor([2, 4])
    ctx.backend.swap_kv_blocks(caches, host, out_src.to(ctx.device), out_dst)
    ctx.backend.swap_kv_blocks(host, caches, in_src, in_dst.to(ctx.device))
    ref_ops.swap_kv_blocks(refs, ref_host, out_src, out_dst)
    ref_ops.swap_kv_blocks(ref_host, refs, in_src, in_dst)
    for i, (c, r) in enumerate(zip(caches, refs)):
        ctx.compare(gather_all(ctx, c, nb), r, f"layer {i} after swap out and back in", exact=True,
                    where=cache_locator)


def _torch_tensors(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(_torch_tensors(x) for x in obj)


# ---- fused ops --------------------------------------------------------------------------------------------------
def check_rms_norm(ctx: CaseContext) -> None:
    hidden = ctx.params["hidden"]
    x = ctx.randn(7, hidden, scale=3.0)
    w = (1.0 + 0.1 * ctx.randn(hidden, dtype=torch.float32)).to(ctx.dtype)
    poison_allocator(x.numel(), ctx.dtype, ctx.device)
    ctx.compare(ctx.backend.rms_norm(x, w, 1e-6), ref_ops.rms_norm(x, w, 1e-6), "rms_norm output")


def check_fused_add_rms_norm(ctx: CaseContext) -> None:
    hidden = ctx.params["hidden"]
    x, residual = ctx.randn(7, hidden, scale=3.0), ctx.randn(7, hidden, scale=3.0)
    w = (1.0 + 0.1 * ctx.randn(hidden, dtype=torch.float32)).to(ctx.dtype)
    want_norm, want_sum = ref_ops.fused_add_rms_norm(x.clone(), residual.clone(), w, 1e-6)
    res0 = residual.clone()
    poison_allocator(x.numel(), ctx.dtype, ctx.device)
    normed, summed = ctx.backend.fused_add_rms_norm(x, residual, w, 1e-6)
    ctx.compare(summed, want_sum, "fused_add_rms_norm residual sum", exact=True)
    ctx.compare(normed, want_norm, "fused_add_rms_norm output")
    ctx.compare(residual, res0, "fused_add_rms_norm leaves residual unchanged", exact=True)


def check_silu_and_mul(ctx: CaseContext) -> None:
    x = ctx.randn(7, 2 * ctx.params["hidden"], scale=2.0)
    poison_allocator(x.numel() // 2, ctx.dtype, ctx.device)
    ctx.compare(ctx.backend.silu_and_mul(x), ref_ops.silu_and_mul(x), "silu_and_mul output")


def check_rotary(ctx: CaseContext) -> None:
    hs, rot, max_pos, t = ctx.params["head_size"], ctx.params["rot_dim"], 64, 9
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device=ctx.device, dtype=ctx.dtype)
    positions = ctx.randint(max_pos, t)
    q, k = ctx.randn(t, 2 * NUM_KV_HEADS, hs), ctx.randn(t, NUM_KV_HEADS, hs)
    q0, k0 = q.clone(), k.clone()
    out_q, out_k = ctx.backend.rotary(positions, q, k, cos_sin)
    ref_q, ref_k = ref_ops.rotary(positions, q0, k0, cos_sin)
    ctx.compare(out_q, ref_q, "rotated query")
    ctx.compare(out_k, ref_k, "rotated key")


def check_apply_token_bitmask(ctx: CaseContext) -> None:
    """Structured-output mask: the mask's width (tokenizer vocab) below and above the logits' width."""
    vocab, width = 100, ctx.params["mask_width"]
    logits = ctx.randn(5, vocab, dtype=torch.float32)
    words = torch.randint(-(2 ** 31), 2 ** 31 - 1, (5, (width + 31) // 32), generator=ctx.gen, dtype=torch.int64)
    bitmask = words.to(torch.int32).to(ctx.device)
    bitmask[0] = -1  # everything allowed (up to the mask's width)
    want = logits.clone()
    ref_ops.apply_token_bitmask(want, bitmask)
    ctx.backend.apply_token_bitmask(logits, bitmask)
    ctx.compare(logits, want, "masked logits", exact=True)


def check_add_lora(ctx: CaseContext) -> None:
    """Multi-LoRA against a per-token gather (punica's bgmv) computed here, on a step mixing 3 slots and base
    tokens, laid out as adjacent equal runs (the batched grid) in slot order or not, or as uneven, interleaved
    runs."""
    slots = {"uniform": [-1, -1, 0, 0, 0, 2, 2, 2, 1, 1, 1, -1],
             "uniform_consecutive": [-1, 1, 1, 1, 2, 2, 2, 3, 3, 3, -1, -1],
             "uneven": [-1, 1, 1, 0, -1, 2, 2, 2, 2, 0, -1, 1]}[ctx.params["layout"]]
    t, d_in, d_out, r = len(slots), 48, 80, 8
    x, y = ctx.randn(t, d_in), ctx.randn(t, d_out)
    a, b = ctx.randn(4, r, d_in, scale=0.3), ctx.randn(4, d_out, r, scale=0.3)
    mapping = LoRAMapping.build(slots, ctx.device)
    if (mapping.uniform is not None) != ctx.params["layout"].startswith("uniform"):
        raise AssertionError(f"mapping for {slots} has uniform={mapping.uniform}")
    want = y.float().clone()
    for i, s in enumerate(slots):
        if s >= 0:
            want[i] += b[s].float() @ (a[s].float() @ x[i].float())
    ctx.backend.add_lora(y, x, a, b, mapping)
    ctx.compare(y, want.to(y.dtype), f"output after add_lora ({ctx.params['layout']} runs)")


def check_fused_moe(ctx: CaseContext) -> None:
    """Every expert hit by several tokens, some by none; routing weights not normalised; k experts per token."""
    t, h, i, e, k = 11, ctx.params["hidden"], ctx.params["intermediate"], ctx.params["experts"], ctx.params["top_k"]
    x = ctx.randn(t, h)
    w13, w2 = ctx.randn(e, 2 * i, h, scale=h ** -0.5), ctx.randn(e, h, i, scale=i ** -0.5)
    ids = torch.stack([torch.tensor(ctx.randperm(e - 1)[:k]) for _ in range(t)]).to(ctx.device)  # expert e-1 idle
    weights = torch.rand(t, k, generator=ctx.gen).to(ctx.device)
    poison_allocator(x.numel(), ctx.dtype, ctx.device)
    ctx.compare(ctx.backend.fused_moe(x, w13, w2, weights, ids), ref_ops.fused_moe(x, w13, w2, weights, ids),
                "fused_moe output")


def check_dense_linear(ctx: CaseContext) -> None:
    """The backend's dense kernel (``quantized_linear("unquantized", dtype)``, e.g. pre-packed weights) against
    ``F.linear`` at a decode-sized and a prefill-sized batch, with and without a bias."""
    from pagedllm.models.dense_linears import dense_weight  # heavy: pagedllm.models, not at CLI start

    n, k = ctx.params["out_features"], ctx.params["in_features"]
    kernel = ctx.backend.quantized_linear("unquantized", str(ctx.dtype).removeprefix("torch."))
    if kernel is None:
        raise Untested("no dense kernel: F.linear serves it")
    w, bias = ctx.randn(n, k, scale=k ** -0.5), ctx.randn(n, scale=0.1)
    state = kernel.prepare(dense_weight(w), ctx.dtype, ctx.device)
    for t in (1, 37):
        x = ctx.randn(t, k)
        ctx.compare(kernel.apply(state, x, bias), torch.nn.functional.linear(x, w, bias),
                    f"dense linear output, {t} tokens, bias")
        ctx.compare(kernel.apply(state, x, None), torch.nn.functional.linear(x, w), f"dense linear, {t} tokens")


# ---- quantized linear ------------------------------------------------------------------------------------------
#: Relative error (Frobenius) allowed against the reference: kernels may round scales and activations to bf16.
QUANT_REL_TOL = 1e-2


def check_quantized_linear(ctx: CaseContext) -> None:
    """The backend's kernel for one method / weight type against core's reference in float32 (dequantize, then
    matmul; W8A8: its exact int8 math), at a decode-sized and a prefill-sized batch, with a bias."""
    method, wtype, n, k = (ctx.params[x] for x in ("method", "weight_type", "out_features", "in_features"))
    kernel = ctx.backend.quantized_linear(method, wtype)
    if kernel is None:
        raise Untested(f"no {method} {wtype} kernel: core's reference serves it")
    if method == "gguf":
        weight = QuantizedWeight(method, wtype, torch.from_numpy(random_blocks(wtype, n, k, np.random.default_rng(
            ctx.seed))), (n, k))
    elif method == "fp8":
        weight = random_fp8_weight(wtype, n, k, torch.Generator().manual_seed(ctx.seed))
    else:
        weight = random_weight(method, wtype, n, k, torch.Generator().manual_seed(ctx.seed))
    state = kernel.prepare(weight, ctx.dtype, ctx.device)
    ref_kernel = reference_kernel(method, wtype)
    ref_state = ref_kernel.prepare(weight, torch.float32, torch.device("cpu"))
    bias = ctx.randn(n, scale=0.1)
    for t in (1, 37):
        x = ctx.randn(t, k)
        out = kernel.apply(state, x, bias)
        ref = ref_kernel.apply(ref_state, x.float().cpu(), bias.float().cpu())
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (t, n) or out.dtype != ctx.dtype:
            raise CheckFailed(f"{method} {wtype} output: expected {ctx.dtype} [{t}, {n}], got "
                              f"{getattr(out, 'dtype', type(out).__name__)} {tuple(getattr(out, 'shape', ()))}")
        rel = ((out.float().cpu() - ref).norm() / ref.norm()).item()
        ctx.max_abs_err = max(ctx.max_abs_err, (out.float().cpu() - ref).abs().max().item())
        if not rel <= QUANT_REL_TOL:
            raise CheckFailed(f"{method} {wtype} with {t} tokens: relative error {rel:.2e} > {QUANT_REL_TOL}")
