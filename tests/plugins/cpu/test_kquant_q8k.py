"""The CPU plugin's int8-activation K-quant kernel (``pagedllm_cpu/csrc/kquant_q8k.cpp``: x quantized to Q8_K per
call, integer dot products per super-block of Q4_K / Q5_K / Q6_K read in place, as llama.cpp decodes): the
quantization bit-exact against a torch transcription of ggml's ``quantize_row_q8_K_ref``; the kernel against a torch
reference over the same int8 activations and the blocks' integer fields (tight: only fp32 summation order differs)
and against core's reference (``gguf.quants`` dequantized weights, fp32 x: loose, the error of 8-bit activations), at
every SIMD level the CPU runs, forced in turn, on odd shapes; the hook's choice (few rows, the override,
``PAGEDLLM_CPU_INT8_ACT``); and a tiny K-quant GGUF whose first 24 greedy tokens through the engine equal those of
the kernel's float64 emulation. (Greedy parity with the fp32 dequantized reference is a property of real weights, not
of random ones, whose near-ties int8 activations flip: measured on SmolLM2 with `pagedllm bench gguf-parity`,
docs/benchmarks.md.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization import QuantizedLinear, dequantize
from pagedllm.quantization.gguf import random_blocks
from pagedllm_cpu import native, quant

from gguf_utils import write_tied_kquant_gguf


@pytest.fixture(autouse=True)
def int8_activations_on(monkeypatch):
    """These tests are of the int8 path, off by default (``PAGEDLLM_CPU_INT8_ACT=1`` switches it on)."""
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "1")

TYPES = ("Q4_K", "Q5_K", "Q6_K")
#: (out, in): N not a multiple of the 16-row work item; 1, 5, 2 and 17 super-blocks (beyond one tile of x the kernel
#: takes the inputs in chunks of 16 super-blocks: two chunks)
SHAPES = [(37, 256), (19, 1280), (5, 512), (3, 4352)]
ROWS = (1, 3, 6)  # a tile of 1, 3, and 4 + 2 rows of x
PROMPTS = [[5, 17, 301, 42, 7, 99, 3, 250, 11, 64, 8], [200, 9, 33, 401, 12, 77, 5, 6]]
LEVELS = {0: "portable", 1: "avx2", 2: "avx512", 3: "avx512vnni"}


def _weight(weight_type: str, n: int, k: int) -> QuantizedWeight:
    blocks = random_blocks(weight_type, n, k, np.random.default_rng(n * k + len(weight_type)))
    return QuantizedWeight("gguf", weight_type, torch.from_numpy(blocks), (n, k))


def _x(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed + rows + k))
    if k >= 512:
        x[0, :256] = 0  # an all-zero super-block: d = 0, q = 0
        x[-1, 256:512] = torch.linspace(-1, 1, 256) * 3  # +-amax tie: the first one sets the sign
    return x


def q8k_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's ``quantize_row_q8_K_ref`` in torch: per 256 values the value of largest magnitude (the first of ties)
    sets iscale = -127 / max, q = round-half-even(iscale * x) (at most 127), d = 1 / iscale; bsums per 16."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 256, 256)
    top = xb.gather(-1, xb.abs().argmax(-1, keepdim=True))
    zero = top == 0
    # tensor / tensor: one correctly rounded fp32 division each, as C's (scalar / tensor multiplies by a reciprocal)
    iscale = torch.where(zero, torch.ones_like(top), torch.full_like(top, -127.0) / top)
    q = torch.where(zero, 0.0, torch.round(iscale * xb).clamp(max=127)).to(torch.int8)
    d = torch.where(zero, 0.0, torch.ones_like(iscale) / iscale).squeeze(-1)
    bsums = q.reshape(m, k // 16, 16).sum(-1, dtype=torch.int16)
    return q.reshape(m, k), d, bsums


def _fields(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The blocks' integers per weight: (scale * q, min, d, dmin) as float64, [N, K / 256, 256] for the first two and
    [N, K / 256] for the others (Q6_K: q - 32 and no min), so w = d * (scale * q) - dmin * min (ggml's layouts)."""
    n, k = w.shape
    raw = w.data.reshape(n, k // 256, -1)
    b = raw.long()
    if w.weight_type == "Q6_K":
        ql, qh = b[..., :128], b[..., 128:192]
        sc = raw[..., 192:208].contiguous().view(torch.int8).long()
        d = raw[..., 208:210].contiguous().view(torch.float16).double().squeeze(-1)
        q, s = torch.empty(n, k // 256, 256, dtype=torch.long), torch.empty(n, k // 256, 256, dtype=torch.long)
        for h in range(2):
            for j in range(4):
                lo = (ql[..., 64 * h + 32 * (j & 1):64 * h + 32 * (j & 1) + 32] >> (4 * (j >> 1))) & 0xF
                hi = (qh[..., 32 * h:32 * h + 32] >> (2 * j)) & 3
                q[..., 128 * h + 32 * j:128 * h + 32 * j + 32] = (lo | (hi << 4)) - 32
                i = 8 * h + 2 * j  # the scales of the two 16s
                s[..., 128 * h + 32 * j:128 * h + 32 * j + 32] = sc[..., i:i + 2].repeat_interleave(16, -1)
        return (s * q).double(), torch.zeros_like(q, dtype=torch.float64), d, torch.zeros_like(d)
    d = raw[..., 0:2].contiguous().view(torch.float16).double().squeeze(-1)
    dmin = raw[..., 2:4].contiguous().view(torch.float16).double().squeeze(-1)
    s = b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 48:176] if w.weight_type == "Q5_K" else b[..., 16:144]
    q = torch.stack([qs.reshape(n, -1, 4, 32) & 0xF, qs.reshape(n, -1, 4, 32) >> 4], 3).reshape(n, -1, 256)
    if w.weight_type == "Q5_K":
        qh = b[..., 16:48]
        q = q | torch.stack([((qh >> i) & 1) << 4 for i in range(8)], -2).reshape(n, -1, 256)
    return (sc.repeat_interleave(32, -1) * q).double(), mn.repeat_interleave(32, -1).double(), d, dmin


def int8_reference(x: torch.Tensor, w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """y = sum over super-blocks of d_x * (d * sum(scale * q * q_x) - dmin * sum(min * q_x)), in float64 (the integer
    sums are exact), and per output the same sum over the products' magnitudes: the scale of fp32 summation error
    (the kernel converts partial integer sums to fp32 per SIMD lane, and they cancel)."""
    qx, dx, _ = q8k_reference(x)
    sq, mn, d, dmin = _fields(w)
    qx = qx.double().reshape(x.shape[0], -1, 256)
    sumi = torch.einsum("nsl,msl->mns", sq, qx)
    summ = torch.einsum("nsl,msl->mns", mn, qx)
    dx = dx.double().unsqueeze(1)
    terms = dx * d * sumi - dx * dmin * summ
    magnitude = (dx * d).abs() * torch.einsum("nsl,msl->mns", sq.abs(), qx.abs()) + (dx * dmin).abs() * torch.einsum(
        "nsl,msl->mns", mn, qx.abs())
    return terms.sum(-1), magnitude.sum(-1)


def _levels(lib) -> list[int]:
    return list(range(lib.kquant_q8k_best_isa() + 1))


@pytest.mark.parametrize("k", (256, 1280))
def test_quantization_is_ggml_q8k_bit_exact(lib, k):
    x = _x(5, k)
    x[1, 7] = 0.5 * x[1].abs().max() / 127 * 3  # a value at a rounding half after scaling is not special-cased
    got, expected = lib.kquant_q8k_quantize(x), q8k_reference(x)
    assert [t.dtype for t in got] == [torch.int8, torch.float32, torch.int16]
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert torch.equal(lib.kquant_q8k_quantize(x.reshape(5, 1, k))[0], expected[0])  # leading dims flattened


def test_fields_decode_to_the_reference_weights():
    """The torch reference's reading of the blocks is ggml's: its weights equal ``gguf.quants``' dequantization."""
    for weight_type in TYPES:
        w = _weight(weight_type, 7, 512)
        sq, mn, d, dmin = _fields(w)
        dense = d.unsqueeze(-1) * sq - dmin.unsqueeze(-1) * mn
        torch.testing.assert_close(dense.reshape(7, 512).float(), dequantize(w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_the_int8_reference_on_every_isa(lib, weight_type, n, k):
    w = _weight(weight_type, n, k)
    dense = dequantize(w)
    for rows in ROWS:
        x = _x(rows, k)
        expected, magnitude = int8_reference(x, w)
        fp32 = torch.nn.functional.linear(x, dense)
        for isa in _levels(lib):
            got = lib.kquant_q8k_gemv(x, w.data, weight_type, isa)
            assert got.dtype == torch.float32 and got.shape == (rows, n), LEVELS[isa]
            err = (got.double() - expected).abs()
            assert (err <= 1e-6 * magnitude + 1e-30).all(), f"{LEVELS[isa]}: {(err / magnitude).max():.2e}"
            # against the fp32 reference only x's 8-bit rounding differs: < 2% of the output's norm
            rel = ((got - fp32).norm() / fp32.norm()).item()
            assert rel < 2e-2, f"{LEVELS[isa]} rows {rows}: relative error {rel:.2e} vs the dequantized weights"


def test_strided_rows_reduced_dtypes_and_errors(lib):
    w = _weight("Q5_K", 21, 512)
    wide = torch.cat([w.data, torch.full((21, 9), 0xFF, dtype=torch.uint8)], dim=1)[:, :w.data.shape[1]]
    x = _x(2, 512)
    assert torch.equal(lib.kquant_q8k_gemv(x, wide, "Q5_K", -1), lib.kquant_q8k_gemv(x, w.data, "Q5_K", -1))
    for dtype in (torch.bfloat16, torch.float16):
        got = lib.kquant_q8k_gemv(x.to(dtype), w.data, "Q5_K", -1)
        assert got.dtype == dtype
        assert torch.equal(got, lib.kquant_q8k_gemv(x.to(dtype).float(), w.data, "Q5_K", -1).to(dtype))
    with pytest.raises(RuntimeError, match="weight_type must be Q4_K, Q5_K or Q6_K, got Q8_0"):
        lib.kquant_q8k_gemv(x, w.data, "Q8_0", -1)
    with pytest.raises(RuntimeError, match=r"blocks must be uint8 \[N, K / 256 \* 176\]"):
        lib.kquant_q8k_gemv(torch.zeros(1, 256), w.data, "Q5_K", -1)
    with pytest.raises(RuntimeError, match="isa 4 is not supported by this CPU"):
        lib.kquant_q8k_gemv(x, w.data, "Q5_K", 4)
    with pytest.raises(RuntimeError, match="K = 100 is not a multiple of 256"):
        lib.kquant_q8k_quantize(torch.zeros(1, 100))


def test_isa_detection(lib):
    """The best level follows the CPU's flags: VNNI on top of AVX-512 (F/BW/VL/DQ), else as the fp32 kernel's."""
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    best = lib.kquant_best_isa()
    assert lib.kquant_q8k_best_isa() == (3 if best == 2 and "avx512_vnni" in flags else best)


def test_hook_takes_int8_activations_for_few_rows(lib, monkeypatch):
    """Up to ``INT8_ACT_MAX_ROWS`` rows the hook runs the int8 kernel (bias added), beyond it the fp32 kernel;
    ``PAGEDLLM_CPU_INT8_ACT=0`` keeps the fp32 kernel for every batch, a misspelt value names the variable; a forced
    ``PAGEDLLM_CPU_KQUANT_ISA`` level applies to both kernels (avx512vnni: the fp32 kernel's avx512)."""
    w = _weight("Q4_K", 40, 512)
    bias = torch.randn(40, generator=torch.Generator().manual_seed(40))
    state = quant.KQUANT.prepare(w, torch.float32, "cpu")
    assert state[0].data_ptr() == w.data.data_ptr() and state[4] == quant.INT8_ACT_MAX_ROWS
    for rows in (1, quant.INT8_ACT_MAX_ROWS, quant.INT8_ACT_MAX_ROWS + 1):
        x = _x(rows, 512)
        int8 = rows <= quant.INT8_ACT_MAX_ROWS
        expected = (lib.kquant_q8k_gemv if int8 else lib.kquant_gemv)(x, w.data, "Q4_K", -1) + bias
        assert torch.equal(quant.KQUANT.apply(state, x, bias), expected)
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "0")
    off = quant.KQUANT.prepare(w, torch.float32, "cpu")
    assert off[4] == 0
    x = _x(1, 512)
    assert torch.equal(quant.KQUANT.apply(off, x, None), lib.kquant_gemv(x, w.data, "Q4_K", -1))
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "maybe")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_INT8_ACT='maybe'"):
        quant.KQUANT.prepare(w, torch.float32, "cpu")
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "1")
    for isa in _levels(lib):
        monkeypatch.setenv("PAGEDLLM_CPU_KQUANT_ISA", LEVELS[isa])
        forced = quant.KQUANT.prepare(w, torch.float32, "cpu")
        assert forced[2] == isa
        assert torch.equal(quant.KQUANT.apply(forced, x, None), lib.kquant_q8k_gemv(x, w.data, "Q4_K", isa))
        xn = _x(quant.INT8_ACT_MAX_ROWS + 1, 512)
        assert torch.equal(quant.KQUANT.apply(forced, xn, None), lib.kquant_gemv(xn, w.data, "Q4_K", min(isa, 2)))


class Int8Emulation:
    """``torch.ops.pagedllm_cpu`` with ``kquant_q8k_gemv`` computed in torch: x quantized by ``q8k_reference`` and
    dequantized, times ``gguf.quants``' dequantized weights, in float64 (what int8 activations mean, summed
    exactly); every other op the library's."""

    def __init__(self, lib):
        self._lib, self._weights = lib, {}

    def __getattr__(self, name: str):
        return getattr(self._lib, name)

    def kquant_q8k_gemv(self, x: torch.Tensor, blocks: torch.Tensor, weight_type: str, isa: int) -> torch.Tensor:
        key = (blocks.data_ptr(), tuple(blocks.shape))
        if key not in self._weights:
            n, k = blocks.shape[0], blocks.shape[1] // {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[weight_type] * 256
            self._weights[key] = dequantize(QuantizedWeight("gguf", weight_type, blocks.contiguous(), (n, k))).double()
        rows = x.reshape(-1, x.shape[-1]).float()
        q, d, _ = q8k_reference(rows)
        xd = (q.double().reshape(rows.shape[0], -1, 256) * d.double().unsqueeze(-1)).reshape(rows.shape)
        return (xd @ self._weights[key].T).float().reshape(*x.shape[:-1], -1).to(x.dtype)


def _greedy(path: str, tokens: int = 24) -> list[list[int]]:
    llm = LLM(path, device="cpu", skip_tokenizer_init=True, max_model_len=128, kv_cache_memory=16 << 20)
    model = llm.llm_engine.model
    packed = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m.kernel_name == "cpu-kquant-gemv"]
    if packed:  # decodes of both prompts (2 rows) take int8 activations in every linear and the head
        assert model.lm_head_kernel[0] is quant.KQUANT.apply and model.lm_head_kernel[1][4] >= len(PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("weight_type", TYPES)
def test_tiny_kquant_gguf_greedy_equals_int8_emulation(lib, tmp_path, monkeypatch, weight_type):
    """A tied 2-layer Llama K-quant GGUF (Q4_K_M-like mix, the LM head over the embedding's Q6_K blocks): the
    engine's first 24 greedy tokens of both prompts through the kernel equal those with the kernel replaced by its
    float64 torch emulation."""
    path = write_tied_kquant_gguf(str(tmp_path / f"tied-{weight_type}.gguf"), weight_type)
    kernel = _greedy(path)
    monkeypatch.setattr(native, "lib", Int8Emulation(lib))
    assert kernel == _greedy(path)
