"""Block-quantized linear layers on the CPU, kept packed: GGUF Q4_0 / Q4_1 (4.5-5 bits per weight) on
``csrc/q4_gemv.cpp``, GGUF Q8_0 on ``csrc/q8_gemv.cpp`` (the blocks as stored), GGUF K-quants (Q4_K, Q5_K, Q6_K:
what Q4_K_M / Q5_K_M files are made of) on ``csrc/kquant_gemv.cpp`` (the blocks as stored; decodes with int8
activations on ``csrc/kquant_q8k.cpp``), on CPUs with AVX-512 VNNI on ``csrc/kquant_r16.cpp`` (repacked
at load into 16-row groups; x in two int8 terms, 1/32512 of a block's largest value),
GPTQ / AWQ / compressed-tensors W4A16 (``GROUPED_INT4``) on torch's int4 kernel; INT8 W8A8 is in ``int8.py``.

GGUF Q4_1 stores ``W = d * q + m`` per block of 32 (q in 0..15), Q4_0 ``W = d * (q - 8)``. ``q4_gemv`` reads the
blocks (repacked at load, same size: 16 output rows interleaved) and computes in fp32 from fp32 activations, so it
matches the fp32 reference up to summation order; it beats ``_weight_int4pack_mm_for_cpu`` (bf16 activations and
scales) at every batch measured (1.7x at one row, 1.2x at 64, docs/cpu-backend.md), so it is the only copy kept.
Until the library is loaded (or without a compiler) calls go to torch's int4 kernel on a copy made then.

With ``PAGEDLLM_CPU_INT8_ACT=1``, decode-sized calls (up to ``INT8_ACT_MAX_ROWS`` rows of x) of Q8_0 / Q4_0 / Q4_1
go to ``csrc/q8act_gemv.cpp`` instead (K-quants to ``csrc/kquant_q8k.cpp``), as llama.cpp does: x quantized once per call to ggml's Q8_0 / Q8_1 blocks, integer dot products per block
(AVX-512 VNNI, AVX2), the same weight bytes; the fp32 kernels convert every weight to fp32 and are compute-bound at
one row. The price is int8 activation error (~0.5% of a layer's output), which flips near-ties of greedy decoding
against the dequantized reference, so the default keeps the fp32-exact kernels (``int8_activations``), and for
K-quants on CPUs with AVX-512 VNNI x in two int8 terms (``kquant_r16.cpp``: 128x finer, as fast as one).

``aten._weight_int4pack_mm_for_cpu`` computes ``x @ W.T`` with ``W[n, k] = (q - 8) * scale + zero`` per group; the
kernel wants bf16 activations (fp32 ones measured 10-20x slower), so fp32 activations are cast around it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from pagedllm.backend.hookspec import QuantizedLinearKernel, QuantizedWeight
from pagedllm_cpu import huge_pages, native

GROUP = 32
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20}
ROWS = 16  # output rows interleaved per group of ``q4_gemv``'s layout


def _repack(weight: QuantizedWeight, alloc: Callable[[int], torch.Tensor] = huge_pages.empty_on_huge_pages
            ) -> torch.Tensor:
    """The blocks in ``csrc/q4_gemv.cpp``'s layout: uint8 ``[ceil(N / 16), K / 32, bytes]``, per block of 16 output
    rows d[16] fp16, m[16] fp16 (Q4_1), then the nibbles as 4 chunks of [16 rows][4 bytes] (weights 8c..8c+7 of
    the block at bits 4j of chunk c's word), so one 64-byte load holds a nibble of all 16 rows per 32-bit lane.
    Written straight into ``alloc(nbytes)`` (by default on 2 MB pages, ``huge_pages``): no copy after."""
    n, k = weight.shape
    nb, scale_bytes = k // GROUP, 4 if weight.weight_type == "Q4_1" else 2
    blocks = weight.data.reshape(n, nb, _BLOCK_BYTES[weight.weight_type])
    groups = -(-n // ROWS)
    blocks = F.pad(blocks, (0, 0, 0, 0, 0, groups * ROWS - n))  # zero rows: d = m = 0
    qs = blocks[..., scale_bytes:]  # low nibbles: elements 0-15, high: 16-31 (ggml)
    q = torch.cat([qs & 0xF, qs >> 4], dim=-1).reshape(groups, ROWS, nb, 4, 8).permute(0, 2, 3, 1, 4)
    nibbles = (q[..., 0::2] | (q[..., 1::2] << 4)).reshape(groups, nb, ROWS * GROUP // 2)
    scales = blocks[..., :scale_bytes].reshape(groups, ROWS, nb, scale_bytes // 2, 2).permute(0, 2, 3, 1, 4)
    width = ROWS * scale_bytes + ROWS * GROUP // 2
    out = alloc(groups * nb * width).view(groups, nb, width)
    return torch.cat([scales.reshape(groups, nb, -1), nibbles], dim=-1, out=out)


def _unpack(packed: torch.Tensor, n: int, has_min: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 ``[N, K]`` in 0..15, d and m fp32 ``[N, K / 32]``) of ``_repack``'s layout."""
    groups, nb, _ = packed.shape
    scale_bytes = 4 * ROWS if has_min else 2 * ROWS
    scales = packed[..., :scale_bytes].contiguous().view(torch.float16).float().reshape(groups, nb, -1, ROWS)
    scales = scales.permute(2, 0, 3, 1).reshape(-1, groups * ROWS, nb)[:, :n]
    nib = packed[..., scale_bytes:].reshape(groups, nb, 4, ROWS, 4)
    q = torch.stack([nib & 0xF, nib >> 4], dim=-1).reshape(groups, nb, 4, ROWS, 8)
    q = q.permute(0, 3, 1, 2, 4).reshape(groups * ROWS, nb * GROUP)[:n]
    return q, scales[0], scales[1] if has_min else -8 * scales[0]


def _dequantize(packed: torch.Tensor, n: int, has_min: bool) -> torch.Tensor:
    """fp32 ``[N, K]``: what ``_repack``'s layout means (``w = d q + m``)."""
    q, d, m = _unpack(packed, n, has_min)
    return (d.unsqueeze(-1) * q.reshape(n, -1, GROUP).float() + m.unsqueeze(-1)).reshape(n, -1)


def bf16_min_rows(dtype: torch.dtype, default: Optional[int] = None) -> Optional[int]:
    """Rows of x from which a GGUF block-quantized linear of a ``dtype`` model runs as a bf16 GEMM
    (``kquant_mm_bf16``: a panel of the weights decoded to bf16 per call, oneDNN on AMX / AVX512-BF16), else None.
    On CPUs with bf16 dot products: bf16 models from ``default`` rows (``BF16_MIN_ROWS`` unless given), float32
    models from ``FLOAT32_GEMM_MIN_ROWS`` (prefill-sized calls; decodes keep the fp32 kernels: the reference's
    weights, fp32 sums); CPUs without them (AVX2-only, portable) keep the fp32 kernels.
    ``PAGEDLLM_CPU_KQUANT_BF16_ROWS=N`` takes the GEMM from N rows for every model dtype, ``off`` never. Decided once
    per process (after the library loaded), so every step of a run takes the same path for the same batch."""
    global _bf16_config
    if native.lib is None:  # (no kernel to run it yet)
        return None
    if _bf16_config is None:
        env = os.environ.get("PAGEDLLM_CPU_KQUANT_BF16_ROWS", "").strip().lower()
        if env and env != "off" and not env.isdigit():
            raise ValueError(f"PAGEDLLM_CPU_KQUANT_BF16_ROWS={env!r}: expected a number of rows or 'off'")
        hardware = bool(native.lib.kquant_has_bf16())
        _bf16_config = (env, hardware)
    env, hardware = _bf16_config
    if env:
        return None if env == "off" else int(env)
    if not hardware:
        return None
    if dtype == torch.bfloat16:
        return default or BF16_MIN_ROWS
    return FLOAT32_GEMM_MIN_ROWS if dtype == torch.float32 else None


#: From this many rows of x the bf16 GEMM beats the fp32 kernels on an AMX Xeon (one thread, docs/cpu-backend.md);
#: Q4_0 / Q4_1 from more (their decode to bf16 is scalar code, ``q4_gemv`` is fast: crossover ~32-48 rows).
BF16_MIN_ROWS = 16
BF16_MIN_ROWS_Q4 = 48
#: A float32 model's calls from this many rows (a prefill chunk: 64 prompts of 8 tokens, or one long prompt's
#: 512-token step) are the bf16 GEMM (x, the weights and the result rounded to bf16, fp32 sums; llama.cpp rounds x to
#: 8 bits on every call): the fp32 kernels are compute-bound there, a 1.7B Q4_K_M's pp2048 ran at 0.39-0.41x
#: llama.cpp's on them, 1.28-1.32x on the GEMM (docs/benchmarks.md). A choice, not a crossover (the GEMM wins from
#: 16-48 rows): decode batches of up to 255 sequences keep the fp32-exact kernels.
FLOAT32_GEMM_MIN_ROWS = 256
_bf16_config: Optional[tuple[str, bool]] = None


def _batched_bf16(x: torch.Tensor, threshold: Optional[int]) -> bool:
    return threshold is not None and x.numel() >= threshold * x.shape[-1]


#: Rows of x up to which GGUF linears quantize x to int8 (``q8act_gemv`` for Q8_0 / Q4_0 / Q4_1, ``kquant_q8k_gemv``
#: for K-quants), as llama.cpp decodes. One thread on an AMX Xeon: 1.3-2.5x the fp32 kernels at 1-8 rows
#: (docs/cpu-backend.md), but the cut-off counts a call's rows, so 8 also quantizes short prompts' prefill and the
#: embedded SmolLM2 then leaves HF's greedy path (one prompt, token 5): 4 keeps 24-token parity there. Larger batches
#: keep the fp32 kernels and the bf16 GEMM.
INT8_ACT_MAX_ROWS = 4
INT8_ACT_ENV = "PAGEDLLM_CPU_INT8_ACT"
_int8_act_config: Optional[int] = None


def int8_activations() -> bool:
    """Whether decode-sized calls quantize x to int8 (``PAGEDLLM_CPU_INT8_ACT=1``: llama.cpp's arithmetic, 1.3-2.5x
    faster kernels, ~0.5% error per layer, which flips near-ties: the embedded SmolLM2 leaves the dequantized
    reference's greedy path at token 1 of "The history of the city begins in the year", a gap of 0.12). Default
    off: the fp32 kernels, exact to the dequantized reference up to summation order (K-quants on CPUs with AVX-512
    VNNI: ``kquant_r16.cpp``'s two int8 terms, 1/32512 of a block's largest value)."""
    value = os.environ.get(INT8_ACT_ENV, "0").strip().lower()
    if value not in ("0", "1", "off", "on", "false", "true"):
        raise ValueError(f"{INT8_ACT_ENV}={value!r}: expected 1 or 0")
    return value in ("1", "on", "true")


def int8_act_rows() -> int:
    """Rows of x up to which GGUF Q8_0 / Q4_0 / Q4_1 linears quantize x to int8 (``csrc/q8act_gemv.cpp``):
    ``INT8_ACT_MAX_ROWS`` with int8 activations on where the CPU has AVX2 or AVX-512 VNNI (the portable integer loop
    is slower than the fp32 kernel), else 0. Decided once per process (after the library loaded), so every step of a
    run takes the same path for the same batch."""
    global _int8_act_config
    if native.lib is None:
        return 0
    if _int8_act_config is None:
        on = int8_activations()
        _int8_act_config = INT8_ACT_MAX_ROWS if on and native.lib.q8act_best_isa() >= 1 else 0
    return _int8_act_config


def _int8_act(x: torch.Tensor) -> bool:
    return x.numel() <= int8_act_rows() * x.shape[-1]


@dataclass
class Q4State:
    """A GGUF Q4 weight in ``q4_gemv``'s layout; ``int4pack`` is torch's packed copy (bf16 scale and zero = m + 8d),
    made only if a call comes before the library is loaded (its 30-90 s first build, or no compiler)."""

    packed: torch.Tensor
    n: int
    has_min: bool
    int4pack: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    bf16_rows: Optional[int] = None  # rows of x from which a call is a bf16 GEMM (``bf16_min_rows``)


def _prepare(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> Q4State:
    return Q4State(_repack(weight), weight.shape[0], weight.weight_type == "Q4_1",
                   bf16_rows=bf16_min_rows(dtype, BF16_MIN_ROWS_Q4))


def _without_library(state: Q4State, x: torch.Tensor) -> torch.Tensor:
    if state.n % 16:  # not a shape torch's int4 kernel takes
        return F.linear(x.float(), _dequantize(state.packed, state.n, state.has_min)).to(x.dtype)
    if state.int4pack is None:
        q, d, m = _unpack(state.packed, state.n, state.has_min)
        scales_zeros = torch.stack([d, m + 8 * d], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
        state.int4pack = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), scales_zeros)
    return _int4_mm(x, state.int4pack[0], GROUP, state.int4pack[1])


def _apply(state: Q4State, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if native.lib is not None and _int8_act(x):
        y = native.lib.q8act_gemv(x, state.packed, "Q4_1" if state.has_min else "Q4_0", state.n)
    elif native.lib is not None and _batched_bf16(x, state.bf16_rows):
        y = native.lib.kquant_mm_bf16(x, state.packed, "Q4_1" if state.has_min else "Q4_0", state.n)
    elif native.lib is not None:
        y = native.lib.q4_gemv(x, state.packed, state.n, state.has_min)
    else:
        y = _without_library(state, x)
    if bias is not None:
        y.add_(bias)
    return y


Q4 = QuantizedLinearKernel(_prepare, _apply, name="cpu-q4-gemv")


def _prepare_q8(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> torch.Tensor:
    """GGUF Q8_0 (``w = d * q``, fp16 d and 32 int8 q a block) needs no repack: ``q8_gemv`` reads the blocks where
    they are (a tied LM head: the token embedding's blocks in the file's mapping, no copy); batches from
    ``bf16_min_rows`` rows (of x's dtype) are a bf16 GEMM over the same blocks, decodes up to ``int8_act_rows``
    ``q8act_gemv`` (int8 activations) over them."""
    return weight.data.reshape(weight.shape[0], -1)


def _apply_q8(blocks: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if _int8_act(x):
        y = native.lib.q8act_gemv(x, blocks, "Q8_0")
    elif _batched_bf16(x, bf16_min_rows(x.dtype)):
        y = native.lib.kquant_mm_bf16(x, blocks, "Q8_0")
    else:
        y = native.lib.q8_gemv(x, blocks)
    if bias is not None:
        y.add_(bias)
    return y


#: Offered only once the library is loaded (``quantized_linear``): it has no torch fallback.
Q8 = QuantizedLinearKernel(_prepare_q8, _apply_q8, name="cpu-q8-gemv")


#: GGUF K-quant types ``kquant_gemv`` reads in place (super-blocks of 256 weights).
KQUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")
#: ``PAGEDLLM_CPU_KQUANT_ISA`` forces a SIMD level of ``kquant_gemv`` and ``kquant_q8k_gemv`` (comparisons): avx512vnni
#: (the int8 kernel's ``vpdpbusd``; the fp32 one runs avx512), avx512, avx2 or portable.
ISA_LEVELS = {"portable": 0, "avx2": 1, "avx512": 2, "avx512vnni": 3}
#: ``kquant_gemv``'s highest level (it has no VNNI variant: its arithmetic is fp32).
_FP32_TOP_LEVEL = 2


def kquant_isa() -> int:
    """The level ``PAGEDLLM_CPU_KQUANT_ISA`` asks for, else -1 (the best the CPU runs, detected by the kernel)."""
    name = os.environ.get("PAGEDLLM_CPU_KQUANT_ISA", "").strip().lower()
    if name and name not in ISA_LEVELS:
        raise ValueError(f"PAGEDLLM_CPU_KQUANT_ISA={name!r}: expected one of {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS.get(name, -1)


#: A super-block's bytes a row in the file and in ``kquant_r16.cpp``'s records (Q4_K and Q5_K scales unpacked there).
_KQUANT_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_R16_ROW_BYTES = {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210}


def _r16(weight: QuantizedWeight, isa: int) -> bool:
    """Whether ``weight`` runs repacked into ``kquant_r16.cpp``'s 16-row layout: a K-quant with whole groups of 16
    output rows, on a CPU with AVX-512 VNNI, no SIMD level forced (a forced level runs that level's kernels over the
    file's blocks)."""
    return isa == -1 and weight.shape[0] % 16 == 0 and bool(native.lib.kquant_r16_available())


def _prepare_kquant(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> tuple:
    """The state: (blocks, type, SIMD level, rows of x from which a call is a bf16 GEMM: ``bf16_min_rows``, never with
    a level forced, which runs that level's fp32 kernel; rows of x up to which a call takes llama.cpp's int8
    activations, 0 when off; whether the blocks are ``kquant_r16.cpp``'s 16-row layout). On CPUs with AVX-512 VNNI,
    K-quants are repacked once at load (the same bytes give or take 3%: the file's pages are then unmapped) and
    decode with x in two int8 terms (error below 1/32512 of a block's largest value; 1.5x the fp32 kernel from
    DRAM); elsewhere no repack and no copy: ``kquant_gemv`` decodes the file's super-blocks where they lie (the
    file's mapping), so a K-quant model's weights cost their file size in memory instead of 7x as fp32."""
    isa = kquant_isa()
    bf16_rows = bf16_min_rows(dtype) if isa == -1 else None
    int8_rows = INT8_ACT_MAX_ROWS if int8_activations() else 0
    blocks = weight.data.reshape(weight.shape[0], -1)
    if _r16(weight, isa):
        packed = huge_pages.empty_on_huge_pages(blocks.shape[0] * blocks.shape[1] // _KQUANT_BYTES[weight.weight_type]
                                                * _R16_ROW_BYTES[weight.weight_type])
        return native.lib.kquant_r16_repack(blocks, weight.weight_type, packed), weight.weight_type, isa, \
            bf16_rows, int8_rows, True
    return blocks, weight.weight_type, isa, bf16_rows, int8_rows, False


def _apply_kquant(state: tuple, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    blocks, weight_type, isa, bf16_rows, int8_rows, r16 = state
    int8 = x.numel() <= int8_rows * x.shape[-1]
    if _batched_bf16(x, bf16_rows):
        y = native.lib.kquant_mm_bf16(x, blocks, weight_type + "_R16" if r16 else weight_type)
    elif r16:
        y = native.lib.kquant_r16_gemv(x, blocks, weight_type, 1 if int8 else 2)
    elif int8:
        y = native.lib.kquant_q8k_gemv(x, blocks, weight_type, isa)
    else:
        y = native.lib.kquant_gemv(x, blocks, weight_type, kquant_fp32_isa(isa))
    if bias is not None:
        y.add_(bias)
    return y


def kquant_fp32_isa(isa: int) -> int:
    """The level ``kquant_gemv`` runs for a K-quant state's ``isa`` (-1: best)."""
    return min(isa, _FP32_TOP_LEVEL)


def fp32_rows(kernel: str, state: Any, dtype: torch.dtype) -> tuple[int, Optional[int]]:
    """(rows of x up to which ``kernel``'s apply over ``state`` takes int8 activations, rows from which it takes the
    bf16 GEMM or None): between them it runs its fp32 kernel (``q4_gemv``, ``q8_gemv``, ``kquant_gemv``; a 16-row
    K-quant state its two-term ``kquant_r16_gemv``), as the applies above decide per call. For code that calls the
    kernels itself (``decode_layers.py``)."""
    if kernel == Q4.name:
        return int8_act_rows(), state.bf16_rows
    if kernel == Q8.name:
        return int8_act_rows(), bf16_min_rows(dtype)
    if kernel == KQUANT.name:
        return state[4], state[3]
    raise ValueError(f"{kernel!r} is not a GGUF block kernel of this backend")


#: Offered only once the library is loaded (``quantized_linear``): it has no torch fallback.
KQUANT = QuantizedLinearKernel(_prepare_kquant, _apply_kquant, name="cpu-kquant-gemv")


def _int4_mm(x: torch.Tensor, packed: torch.Tensor, group: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """``x @ W.T`` in x's dtype, activations cast to bf16 around the kernel: one C++ call once ``native`` is loaded
    (``csrc/int4_linear.cpp``, the same ATen ops without four Python dispatches), else those ops here."""
    if native.lib is not None:
        return native.lib.int4pack_linear(x, packed, group, scales_zeros)
    shape = x.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), packed, group,
                                                   scales_zeros).to(x.dtype)
    return y.reshape(*shape[:-1], y.shape[-1])


logger = logging.getLogger(__name__)
#: Group sizes ``_weight_int4pack_mm_for_cpu`` takes; it also wants out_features divisible by 16.
KERNEL_GROUPS = (32, 64, 128, 256)


def _prepare_grouped(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> tuple:
    """GPTQ / AWQ / compressed-tensors int4 ``W = (q - z) * s`` as the kernel's ``(q - 8) * s + zero``: zero =
    (8 - z) * s. GPTQ ``desc_act`` groups are made contiguous by permuting the input columns once here (and the
    activations per call, as exllama does). Shapes the kernel cannot take run dense (logged)."""
    from pagedllm.backend import get_method

    g = get_method(weight.method).unpack(weight)
    n, k = g.q.shape
    perm = torch.argsort(g.g_idx, stable=True)
    size = k // g.scales.shape[0] if k % g.scales.shape[0] == 0 else 0
    ok = size in KERNEL_GROUPS and n % 16 == 0 and torch.equal(g.g_idx[perm], torch.arange(k) // size)
    if not ok:
        logger.info("%s %s [%d, %d] (group %s): not a cpu-int4pack shape (out %% 16, group in %s); dense %s",
                    weight.method, weight.weight_type, n, k, size or "uneven", KERNEL_GROUPS, dtype)
        return ("dense", g.dense().to(device=device, dtype=dtype))
    scale_zero = torch.stack([g.scales, (8 - g.zeros) * g.scales], dim=-1).to(torch.bfloat16)
    identity = torch.equal(perm, torch.arange(k))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(g.q[:, perm].contiguous(), 1)
    return ("int4", packed, scale_zero.contiguous(), size, None if identity else perm)


def _apply_grouped(state: tuple, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    if state[0] == "dense":
        return F.linear(x, state[1], bias)
    _, packed, scale_zero, size, perm = state
    y = _int4_mm(x if perm is None else x.index_select(-1, perm), packed, size, scale_zero)
    if bias is not None:
        y.add_(bias)
    return y


GROUPED_INT4 = QuantizedLinearKernel(_prepare_grouped, _apply_grouped, name="cpu-int4pack")
#: (method, weight_type) pairs on ``GROUPED_INT4``.
GROUPED_TYPES = {("gptq", "int4"), ("awq", "int4"), ("compressed-tensors", "W4A16")}


def _prepare_fp8(weight: QuantizedWeight, dtype: torch.dtype, device: Any) -> tuple:
    """Dequantized once at load (an fp8 -> float conversion per forward costs 40x the matmul on CPU), then packed for
    oneDNN like any dense weight where oneDNN runs ``dtype``."""
    from pagedllm.backend import dequantize
    from pagedllm_cpu import dense

    w = QuantizedWeight("unquantized", str(dtype).removeprefix("torch."), dequantize(weight).to(dtype), weight.shape)
    if dense.supported(w.weight_type):
        return dense.ONEDNN.apply, dense.ONEDNN.prepare(w, dtype, device)
    return torch.nn.functional.linear, w.data


def _apply_fp8(state: tuple, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    fn, w = state
    return fn(w, x, bias) if fn is not torch.nn.functional.linear else fn(x, w, bias)


FP8 = QuantizedLinearKernel(_prepare_fp8, _apply_fp8, name="cpu-fp8-dequantized")


def quantized_linear(method: str, weight_type: str) -> Optional[QuantizedLinearKernel]:
    """Dense fp32/bf16 on oneDNN packed weights; Q4_0 / Q4_1 on ``q4_gemv``, Q8_0 on ``q8_gemv`` and Q4_K / Q5_K /
    Q6_K on ``kquant_gemv`` once the library is loaded (else core's reference), the 4-bit GPTQ / AWQ /
    compressed-tensors types on the int4 kernel, W8A8 on ``int8.py``'s; fp8 dequantized at load onto the dense
    path; every other type is left to core's reference."""
    if method == "unquantized":
        from pagedllm_cpu import dense

        return dense.ONEDNN if dense.supported(weight_type) else None
    if method == "fp8":
        return FP8
    if method == "gguf" and weight_type in _BLOCK_BYTES:
        return Q4
    if (method, weight_type) == ("gguf", "Q8_0"):
        native.start_build()  # a cached library loads now: every load of this process answers the same
        return Q8 if native.lib is not None else None
    if method == "gguf" and weight_type in KQUANT_TYPES:
        native.start_build()
        return KQUANT if native.lib is not None else None
    if (method, weight_type) in GROUPED_TYPES:
        return GROUPED_INT4
    if (method, weight_type) == ("compressed-tensors", "W8A8"):
        from pagedllm_cpu.int8 import W8A8

        return W8A8
    return None
