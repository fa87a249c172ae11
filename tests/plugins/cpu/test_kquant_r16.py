"""The CPU plugin's 16-row K-quant decode kernel (``pagedllm_cpu/csrc/kquant_r16.cpp``, CPUs with AVX-512 VNNI):
the repacked layout gives the file's blocks back bit for bit; x as the kernel quantizes it (two int8 terms, a scale
per 32 values; or llama.cpp's Q8_K with one term); products against an fp64 reference over the same quantized x
(fp32-close) and over x itself (the two terms' bound); one term against ``kquant_q8k_gemv`` (the same integers);
the batched bf16 GEMM over the layout bit for bit the GEMM over the file's blocks; the hook repacking exactly
where it should. On CPUs without AVX-512 VNNI the kernel refuses to run and the engine never repacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization import dequantize
from pagedllm.quantization.gguf import random_blocks
from pagedllm_cpu import native, quant

TYPES = ("Q4_K", "Q5_K", "Q6_K")
RECORD = {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210}  # bytes a row per super-block (the file's: 144, 176, 210)


@pytest.fixture(scope="module")
def lib():
    assert native.get(wait=True, timeout=600) is not None, native.error()
    return native.lib


@pytest.fixture()
def vnni(lib):
    if not lib.kquant_r16_available():
        pytest.skip("this CPU has no AVX-512 VNNI: kquant_r16 does not run here "
                    "(test_runs_with_vnni_and_is_refused_without checks the refusal)")
    return lib


def _weight(weight_type: str, n: int, k: int, seed: int = 0) -> QuantizedWeight:
    blocks = random_blocks(weight_type, n, k, np.random.default_rng(seed + n * k))
    return QuantizedWeight("gguf", weight_type, torch.from_numpy(blocks), (n, k))


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2
    x[:, 5] = 40.0  # an outlier channel, as in LLM activations: it coarsens the scale of its own 32 values only
    return x


def _as_quantized(lib, x: torch.Tensor, terms: int) -> torch.Tensor:
    """x as the kernel sees it, in fp64: d * (128 hi + lo) per 32 values (one term: d * hi)."""
    hi, lo, d, _ = lib.kquant_r16_quantize(x, terms)
    v = hi.double() * 128 + lo.double() if terms == 2 else hi.double()
    return (v.reshape(x.shape[0], -1, 32) * d.double()[..., None]).reshape(x.shape)


def test_runs_with_vnni_and_is_refused_without(lib):
    """Where the CPU has AVX-512 VNNI the op runs and the hook repacks; where it lacks it the op says so and the hook
    keeps the file's blocks (the kernels of test_kquant_kernels.py run instead)."""
    w = _weight("Q4_K", 16, 256)
    packed = lib.kquant_r16_repack(w.data, "Q4_K")  # (plain C++: every CPU)
    x = torch.zeros(1, 256)
    if lib.kquant_r16_available():
        assert lib.kquant_r16_gemv(x, packed, "Q4_K", 2).shape == (1, 16)
        assert quant.KQUANT.prepare(w, torch.float32, "cpu")[5] is True
    else:
        with pytest.raises(RuntimeError, match="needs AVX-512 VNNI"):
            lib.kquant_r16_gemv(x, packed, "Q4_K", 2)
        assert quant.KQUANT.prepare(w, torch.float32, "cpu")[5] is False


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("shape", [(16, 256), (48, 1280), (32, 2048)])
def test_repack_round_trips_bit_for_bit(lib, weight_type, shape):
    w = _weight(weight_type, *shape)
    packed = lib.kquant_r16_repack(w.data, weight_type)
    assert packed.shape == (shape[0] // 16, shape[1] // 256 * 16 * RECORD[weight_type])
    assert torch.equal(lib.kquant_r16_unpack(packed, weight_type), w.data)
    out = torch.empty(packed.numel(), dtype=torch.uint8)  # the caller places the records (huge pages, at load)
    into = lib.kquant_r16_repack(w.data, weight_type, out)
    assert into.data_ptr() == out.data_ptr() and torch.equal(into, packed)


def test_repack_errors_name_the_problem(lib):
    with pytest.raises(RuntimeError, match="out must be a contiguous uint8 tensor of 2368 bytes"):
        lib.kquant_r16_repack(_weight("Q4_K", 16, 256).data, "Q4_K", torch.empty(2367, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        lib.kquant_r16_repack(_weight("Q4_K", 24, 256).data, "Q4_K")
    with pytest.raises(RuntimeError, match="weight_type must be Q4_K, Q5_K or Q6_K, got Q8_0"):
        lib.kquant_r16_repack(_weight("Q4_K", 16, 256).data, "Q8_0")


def test_quantize_two_terms_and_one(lib):
    """Two terms: v = 128 hi + lo with hi in -127..127, lo in 0..127, |x - d v| <= d / 2, d = max|x| / 16256 per 32
    values, the sums of v per 16 exact. One term: llama.cpp's Q8_K, the integers and scale ``kquant_q8k_quantize``
    gives."""
    x = _x(3, 512, 0)
    hi, lo, d, sums = lib.kquant_r16_quantize(x, 2)
    assert int(hi.min()) >= -127 and int(hi.max()) <= 127 and int(lo.min()) >= 0 and int(lo.max()) <= 127
    v = hi.int() * 128 + lo.int()
    blocks = x.reshape(3, -1, 32)
    torch.testing.assert_close(d, blocks.abs().amax(-1) / 16256, rtol=1e-6, atol=0)
    err = (x - _as_quantized(lib, x, 2).float()).abs().reshape(3, -1, 32)
    assert bool((err <= d[..., None] * 0.5 * (1 + 1e-5)).all())
    assert torch.equal(sums, v.reshape(3, -1, 16).sum(-1).float())
    xb = x.reshape(3, -1, 32)  # the same fp32 operations in torch: v = round-half-even(x * (16256 / max)), clamped
    amax = xb.abs().amax(-1, keepdim=True)
    want = torch.round(xb * (16256 / amax)).clamp(-16256, 16256).reshape(3, -1).int()
    assert torch.equal(v, want)  # (the AVX-512 path on CPUs with VNNI, else the scalar one)
    q1, d1, s1 = lib.kquant_q8k_quantize(x)
    hi1, lo1, dd1, sums1 = lib.kquant_r16_quantize(x, 1)
    assert torch.equal(hi1, q1) and not bool(lo1.any())
    assert torch.equal(dd1, d1.repeat_interleave(8, dim=1)) and torch.equal(sums1, s1.float())


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_products_against_fp64(vnni, weight_type, rows):
    """Two terms: fp32-close (2e-6 of the largest output) to the fp64 product over the same quantized x, and within
    2e-4 of it over x itself (measured <= 1.1e-4 with the outlier); one term equals ``kquant_q8k_gemv`` (llama.cpp's
    integers) to fp32 rounding."""
    lib = vnni
    for n, k in ((32, 256), (48, 1024), (64, 2048)):
        w = _weight(weight_type, n, k, rows)
        packed = lib.kquant_r16_repack(w.data, weight_type)
        dense = dequantize(w).double()
        x = _x(rows, k, n + rows)
        exact = x.double() @ dense.T
        scale = exact.abs().max().item()
        two = lib.kquant_r16_gemv(x, packed, weight_type, 2)
        assert two.dtype == torch.float32 and two.shape == (rows, n)
        assert (two.double() - _as_quantized(lib, x, 2) @ dense.T).abs().max().item() <= 2e-6 * scale
        assert (two.double() - exact).abs().max().item() <= 2e-4 * scale
        one = lib.kquant_r16_gemv(x, packed, weight_type, 1)
        assert (one.double() - _as_quantized(lib, x, 1) @ dense.T).abs().max().item() <= 2e-6 * scale
        q8k = lib.kquant_q8k_gemv(x, w.data, weight_type, -1)
        assert (one - q8k).abs().max().item() <= 2e-6 * scale


@pytest.mark.parametrize("weight_type", TYPES)
def test_a_row_does_not_depend_on_the_rows_beside_it(vnni, weight_type):
    """One row of x keeps its sums in registers, more rows keep them in memory and take each record once for all:
    the same operations per row, so each row of a 1-, 5- or 12-row call (above the 8 rows of the kernel's stack
    buffer) is bit for bit that row alone, both terms (a decode batch's tokens do not depend on its size)."""
    lib = vnni
    w = _weight(weight_type, 48, 2048)
    packed = lib.kquant_r16_repack(w.data, weight_type)
    x = _x(12, 2048, 3)
    for terms in (1, 2):
        alone = torch.cat([lib.kquant_r16_gemv(x[i:i + 1], packed, weight_type, terms) for i in range(12)])
        assert torch.equal(lib.kquant_r16_gemv(x[:5], packed, weight_type, terms), alone[:5])
        assert torch.equal(lib.kquant_r16_gemv(x, packed, weight_type, terms), alone)


def test_joined_parts_are_the_parts_joined(vnni):
    """A fused linear's parts in different types (a Q4_K_M's q and k Q4_K beside a Q6_K v) in one call: each part's
    outputs bit for bit its own call's, at 1 and 3 rows, both terms, on 1 to 3 threads (the threads' shares split by
    bytes, so inside a part); more threads than groups; mismatched lists, a K-mismatched part and an unknown type
    named."""
    lib = vnni
    types = ["Q4_K", "Q4_K", "Q6_K", "Q5_K"]
    parts = [lib.kquant_r16_repack(_weight(t, n, 512, i).data, t)
             for i, (t, n) in enumerate(zip(types, (48, 16, 32, 64)))]
    threads = torch.get_num_threads()
    try:
        for nt in (1, 2, 3):
            torch.set_num_threads(nt)
            for rows in (1, 3):
                x = _x(rows, 512, rows)
                for terms in (1, 2):
                    alone = torch.cat([lib.kquant_r16_gemv(x, w, t, terms) for w, t in zip(parts, types)], -1)
                    assert torch.equal(lib.kquant_r16_gemv_joined(x, parts, types, terms), alone)
                    assert torch.equal(lib.kquant_r16_gemv_joined(x, parts[1:2], types[1:2], terms),
                                       lib.kquant_r16_gemv(x, parts[1], types[1], terms))
    finally:
        torch.set_num_threads(threads)
    x = _x(1, 512, 0)
    with pytest.raises(RuntimeError, match="2 packed parts for 1 weight types"):
        lib.kquant_r16_gemv_joined(x, parts[:2], types[:1])
    with pytest.raises(RuntimeError, match="kquant_r16_gemv_joined: packed must be contiguous uint8"):
        lib.kquant_r16_gemv_joined(_x(1, 256, 0), parts[:1], types[:1])
    with pytest.raises(RuntimeError, match="weight_type must be Q4_K, Q5_K or Q6_K, got Q8_0"):
        lib.kquant_r16_gemv_joined(x, parts[:1], ["Q8_0"])


def test_reduced_dtypes_and_shapes(vnni):
    lib = vnni
    w = _weight("Q4_K", 32, 512)
    packed = lib.kquant_r16_repack(w.data, "Q4_K")
    x = _x(6, 512, 1).reshape(2, 3, 512)
    full = lib.kquant_r16_gemv(x.reshape(6, 512), packed, "Q4_K", 2)
    assert torch.equal(lib.kquant_r16_gemv(x, packed, "Q4_K", 2), full.reshape(2, 3, 32))
    for dtype in (torch.bfloat16, torch.float16):
        got = lib.kquant_r16_gemv(x.to(dtype), packed, "Q4_K", 2)
        assert got.dtype == dtype
        assert torch.equal(got, lib.kquant_r16_gemv(x.to(dtype).float(), packed, "Q4_K", 2).to(dtype))
    with pytest.raises(RuntimeError, match=r"packed must be contiguous uint8 \[N / 16, K / 256 \* 2368\]"):
        lib.kquant_r16_gemv(torch.zeros(1, 256), packed, "Q4_K", 2)
    with pytest.raises(RuntimeError, match="terms must be 1 or 2, got 3"):
        lib.kquant_r16_gemv(torch.zeros(1, 512), packed, "Q4_K", 3)


@pytest.mark.parametrize("weight_type", TYPES)
def test_bf16_gemm_over_the_layout_is_the_gemm_over_the_file(lib, weight_type):
    """Prefill-sized calls take ``kquant_mm_bf16`` over the 16-row records, each turned back into the file's
    super-blocks: the same bits as over the file's blocks."""
    w = _weight(weight_type, 48, 768)
    packed = lib.kquant_r16_repack(w.data, weight_type)
    x = _x(20, 768, 2)
    assert torch.equal(lib.kquant_mm_bf16(x, packed, weight_type + "_R16"), lib.kquant_mm_bf16(x, w.data, weight_type))
    with pytest.raises(RuntimeError, match=r"Q4_K_R16 blocks must be contiguous uint8 \[N / 16, K / 256 \* 2368\]"):
        lib.kquant_mm_bf16(torch.zeros(1, 512), packed, "Q4_K_R16")


def test_hook_repacks_where_the_kernel_runs(vnni, monkeypatch):
    """K-quants with whole groups of 16 rows are repacked at load (the decode calls then take two terms, or with
    ``PAGEDLLM_CPU_INT8_ACT=1`` llama.cpp's one up to ``INT8_ACT_MAX_ROWS`` rows); a row count that is not a
    multiple of 16 or a SIMD level forced keep the file's blocks."""
    lib = vnni
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "0")
    w = _weight("Q6_K", 32, 512)
    state = quant.KQUANT.prepare(w, torch.float32, "cpu")
    assert state[5] is True and state[0].data_ptr() != w.data.data_ptr()
    assert torch.equal(state[0], lib.kquant_r16_repack(w.data, "Q6_K"))
    x = _x(2, 512, 3)
    bias = torch.randn(32, generator=torch.Generator().manual_seed(32))
    assert torch.equal(quant.KQUANT.apply(state, x, bias), lib.kquant_r16_gemv(x, state[0], "Q6_K", 2) + bias)
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "1")
    int8 = quant.KQUANT.prepare(w, torch.float32, "cpu")
    assert torch.equal(quant.KQUANT.apply(int8, x, None), lib.kquant_r16_gemv(x, int8[0], "Q6_K", 1))
    x5 = _x(5, 512, 4)  # beyond INT8_ACT_MAX_ROWS: two terms
    assert torch.equal(quant.KQUANT.apply(int8, x5, None), lib.kquant_r16_gemv(x5, int8[0], "Q6_K", 2))
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "0")
    assert quant.KQUANT.prepare(_weight("Q5_K", 32, 512), torch.float32, "cpu")[5] is True
    for kept in (_weight("Q5_K", 40, 512), _weight("Q4_K", 40, 512)):
        st = quant.KQUANT.prepare(kept, torch.float32, "cpu")
        assert st[5] is False and st[0].data_ptr() == kept.data.data_ptr()
    monkeypatch.setenv("PAGEDLLM_CPU_KQUANT_ISA", "avx512vnni")
    forced = quant.KQUANT.prepare(w, torch.float32, "cpu")
    assert forced[5] is False and forced[0].data_ptr() == w.data.data_ptr()
