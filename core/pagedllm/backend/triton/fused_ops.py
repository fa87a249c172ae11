"""Triton versions of the small fused ops (RMSNorm, neox rotary, SiLU-and-mul), fp32 math, one row per program."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.backend.triton import next_pow2


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, n, stride_x, stride_o, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    h = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
    # HF order: normalise in fp32, round to the input dtype, then scale by the weight.
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.result_type(x, weight), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, n, x2.stride(0), out.stride(0), float(eps),
                                          BLOCK=next_pow2(n))
    return out.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    a = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    y = a / (1.0 + tl.exp(-a)) * b
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(d))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(d, block))](x2, out, d, x2.stride(0), out.stride(0),
                                                                   BLOCK=block)
    return out.view(*x.shape[:-1], d)


@triton.jit
def _rotary_kernel(pos_ptr, x_ptr, cs_ptr, num_heads, half, stride_xt, stride_xh, stride_cs,
                   HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """In place on ``x`` (a fresh copy made by the launcher): neox rotation of the first ``2 * half`` features."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    h = tl.arange(0, HEADS_PAD)[:, None]
    j_ok = j < half
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cs_ptr + pos * stride_cs + half + j, mask=j_ok, other=0.0).to(tl.float32)[None, :]
    mask = (h < num_heads) & j_ok[None, :]
    p1 = x_ptr + t * stride_xt + h * stride_xh + j[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p1 + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns rotated copies of ``[T, H, D]`` query and key (features past ``rot_dim`` pass through)."""
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    outs = []
    for x in (query, key):
        y = x.clone(memory_format=torch.contiguous_format)
        if y.shape[0]:
            _rotary_kernel[(y.shape[0],)](positions, y, cs, y.shape[1], half, y.stride(0), y.stride(1), cs.stride(0),
                                          HEADS_PAD=next_pow2(y.shape[1]), HALF_PAD=next_pow2(half))
        outs.append(y)
    return outs[0], outs[1]
