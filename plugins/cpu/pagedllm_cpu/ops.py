"""Elementwise ops measured faster than core's reference on CPU: the C++ ones (``native.py``) once loaded, else
torch paths (a cold build, no compiler, or a case the C++ op does not take)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.backend import ref_ops
from pagedllm_cpu import native

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Direct:
    """``native.lib``'s ops as the callables of their one overload, resolved on first use: calling the packet
    (``lib.rms_norm(...)``) matches the arguments against its overloads on every call, ~1.5 us of a ~3 us call at
    decode sizes, and a decode layer makes five such calls here. Read only once ``native.lib`` is loaded."""

    def __getattr__(self, name: str):
        overload = getattr(native.lib, name).default
        fn = getattr(overload, "_op", overload)  # the bound C++ op; the OpOverload itself if torch renames it
        setattr(self, name, fn)
        return fn


#: ``direct.rms_norm(...)``: the library's ops without the per-call overload matching (see ``_Direct``).
direct = _Direct()


def rotary(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ref_ops.rotary`` bit for bit (x1*cos - x2*sin, x2*cos + x1*sin): one C++ call (``csrc/rotary.cpp``), or
    torch without the reference's cat/rotate_half temporaries (1.3-1.6x faster than it on a 64-token decode step,
    5x on a 1024-token prefill)."""
    lib = native.lib
    if (lib is not None and query.dtype in _NATIVE_DTYPES and cos_sin_cache.dtype in (torch.float32, query.dtype)
            and query.stride(-1) == 1 and key.stride(-1) == 1 and key.dtype == query.dtype):
        return direct.rotary(positions, query, key, cos_sin_cache)
    cs = cos_sin_cache.index_select(0, positions.long())
    half = cs.shape[-1] // 2
    rot = 2 * half

    def apply(x: torch.Tensor) -> torch.Tensor:
        cos, sin = cs[:, None, :half].to(x.dtype), cs[:, None, half:].to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:rot]
        out = torch.empty_like(x)
        torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
        torch.mul(x2, cos, out=out[..., half:rot]).add_(x1 * sin)
        if rot < x.shape[-1]:
            out[..., rot:] = x[..., rot:]
        return out

    return apply(query), apply(key)


def _native_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (native.lib is not None and x.dtype in _NATIVE_DTYPES and weight.dtype == x.dtype
            and weight.is_contiguous() and x.numel() > 0)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """One C++ call (``csrc/rms_norm.cpp``, HF's order of casts); else, fp32: torch's fused kernel (one pass
    instead of five ops, ~25% faster at decode sizes), other dtypes the reference."""
    if _native_norm(x, weight):
        return direct.rms_norm(x, weight, eps)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return ref_ops.rms_norm(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x += residual`` then its RMSNorm in one C++ pass over the row; else the add, then ``rms_norm``."""
    if (_native_norm(x, weight) and x.dim() == 2 and residual.shape == x.shape and residual.dtype == x.dtype
            and x.stride(-1) == 1 and residual.stride(-1) == 1):
        return direct.fused_add_rms_norm(x, residual, weight, eps), x
    x.add_(residual)
    return rms_norm(x, weight, eps), x


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """One C++ pass per row (``csrc/silu_and_mul.cpp``; 64 x 1536 fp32: ~23 us against ~43 for torch's silu then
    mul); else the reference's math, multiplying in place into silu's output (one temporary fewer)."""
    if native.lib is not None and x.dtype in _NATIVE_DTYPES and x.dim() == 2 and x.stride(-1) == 1 and x.numel():
        return direct.silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])


#: Byte -> the 8 tokens it covers as additive logits (0.0 allowed, -inf not): bit j of byte b is token 8*b + j
#: (the int32 words are little-endian, so their bytes are in token order).
_BYTE_TO_BIAS = torch.where(((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool(), 0.0, float("-inf"))


_scratch_buf: dict = {}


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer for the bias: a fresh 12 MB tensor per step (64 x 49k) is mmap-ed and page-faulted every
    time, which cost more than the lookup itself."""
    buf = _scratch_buf.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = _scratch_buf[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(numel // 8, 8)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured-output mask as an additive bias looked up per mask byte: one ``index_select`` and one ``add_``,
    no per-bit work. 64 rows x 49k vocab: ~1.7 ms against ~9 ms for xgrammar's CPU kernel and ~10 ms for the
    reference (whose bool ``masked_fill_`` alone costs ~7 ms on a random mask). ``x + 0.0`` leaves every allowed
    logit as it was; logits are finite (or -inf), so no +inf meets -inf."""
    rows, vocab = logits.shape
    nbytes = bitmask.shape[-1] * 4
    idx = bitmask.contiguous().view(torch.uint8).flatten().long()
    bias = torch.index_select(_BYTE_TO_BIAS.to(logits.dtype), 0, idx, out=_scratch(idx.numel() * 8, logits.dtype))
    bias = bias.view(rows, nbytes * 8)
    if nbytes * 8 >= vocab:
        logits.add_(bias[:, :vocab])
    else:  # tokens past the tokenizer's vocab are never allowed
        logits[:, :nbytes * 8].add_(bias)
        logits[:, nbytes * 8:] = float("-inf")
