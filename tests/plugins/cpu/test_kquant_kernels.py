"""The CPU plugin's GGUF K-quant kernel (``pagedllm_cpu/csrc/kquant_gemv.cpp``: Q4_K, Q5_K, Q6_K read in place)
against core's reference (the same blocks dequantized by ``gguf.quants``, then an fp32 matmul): every SIMD level the
CPU runs, forced in turn; batch 1, 7 and 64; K a multiple of 256 (one chunk of 512, several, and a half chunk), N
not a multiple of the kernel's 16-row work item nor its 4-row micro tile; strided rows; reduced-dtype activations;
the hook offering it (no copy of the blocks) only once the library is loaded; and a tiny K-quant GGUF whose greedy
tokens through the packed path equal those through the dequantized reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization import QuantizedLinear, dequantize
from pagedllm.quantization.gguf import random_blocks
from pagedllm.quantization.linear import SplitQuantizedLinear
from pagedllm_cpu import native, quant

from gguf_utils import write_tied_kquant_gguf

TYPES = ("Q4_K", "Q5_K", "Q6_K")
SHAPES = [(37, 256), (70, 1280), (19, 512)]  # (out, in): N % 16 and N % 4 != 0; K = 256, 2.5 chunks, 1 chunk
PROMPTS = [[5, 17, 301, 42, 7, 99, 3, 250, 11, 64, 8], [200, 9, 33, 401, 12, 77, 5, 6]]


@pytest.fixture(autouse=True)
def fp32_activations(monkeypatch):
    """Few-row calls here are the fp32 kernel's (``PAGEDLLM_CPU_INT8_ACT=0``; int8 activations:
    test_kquant_q8k.py)."""
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "0")


def _weight(weight_type: str, n: int, k: int) -> QuantizedWeight:
    blocks = random_blocks(weight_type, n, k, np.random.default_rng(n * k))
    return QuantizedWeight("gguf", weight_type, torch.from_numpy(blocks), (n, k))


def _levels(lib) -> list[int]:
    """Every SIMD level this CPU runs: 0 portable, 1 AVX2, 2 AVX-512."""
    return list(range(lib.kquant_best_isa() + 1))


def _assert_fp32_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 tolerance of a K-long dot product: only the order of the sums differs from the reference."""
    torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5 * expected.abs().max().item())


@pytest.mark.parametrize("weight_type", TYPES)
@pytest.mark.parametrize("n,k", SHAPES)
def test_kernel_matches_reference_on_every_isa(lib, weight_type, n, k):
    w = _weight(weight_type, n, k)
    dense = dequantize(w)
    for rows in (1, 7, 64):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
        expected = torch.nn.functional.linear(x, dense)
        for isa in _levels(lib):
            got = lib.kquant_gemv(x, w.data, weight_type, isa)
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            _assert_fp32_close(got, expected)


def test_isa_levels_are_detected_and_forced(lib, monkeypatch):
    """The CPU's best level is detected at run time (AVX-512 needs F/BW/VL/DQ); a level it lacks is refused by
    name; ``PAGEDLLM_CPU_KQUANT_ISA`` forces one for the engine's layers, a misspelt value names the variable."""
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    assert lib.kquant_best_isa() == (2 if avx512 else 1 if {"avx2", "fma", "f16c"} <= flags else 0)
    w = _weight("Q4_K", 16, 256)
    if lib.kquant_best_isa() < 2:
        with pytest.raises(RuntimeError, match="isa 2 is not supported by this CPU"):
            lib.kquant_gemv(torch.zeros(1, 256), w.data, "Q4_K", 2)
    with pytest.raises(RuntimeError, match="weight_type must be Q4_K, Q5_K or Q6_K, got Q8_0"):
        lib.kquant_gemv(torch.zeros(1, 256), w.data, "Q8_0", -1)
    with pytest.raises(RuntimeError, match=r"blocks must be uint8 \[N, K / 256 \* 144\]"):
        lib.kquant_gemv(torch.zeros(1, 512), w.data, "Q4_K", -1)
    monkeypatch.setenv("PAGEDLLM_CPU_KQUANT_ISA", "portable")
    state = quant.KQUANT.prepare(w, torch.float32, "cpu")
    assert state[2] == 0
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quant.KQUANT.apply(state, x, None), lib.kquant_gemv(x, w.data, "Q4_K", 0))
    monkeypatch.setenv("PAGEDLLM_CPU_KQUANT_ISA", "sse9")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KQUANT_ISA='sse9'"):
        quant.KQUANT.prepare(w, torch.float32, "cpu")


@pytest.mark.parametrize("weight_type", TYPES)
def test_hook_reads_the_blocks_in_place(lib, weight_type):
    w = _weight(weight_type, 37, 512)
    kernel = quant.quantized_linear("gguf", weight_type)
    assert kernel is quant.KQUANT
    state = kernel.prepare(w, torch.float32, "cpu")
    assert state[0].data_ptr() == w.data.data_ptr()  # the blocks as given, not a copy
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(5))
    bias = torch.randn(37, generator=torch.Generator().manual_seed(37))
    _assert_fp32_close(kernel.apply(state, x, bias), torch.nn.functional.linear(x, dequantize(w), bias))


def test_strided_rows_and_reduced_dtypes(lib):
    """Rows of a wider table are read with their stride; bf16 / fp16 activations are computed in fp32 and the result
    rounded once."""
    w = _weight("Q5_K", 21, 512)
    wide = torch.cat([w.data, torch.full((21, 9), 0xFF, dtype=torch.uint8)], dim=1)[:, :w.data.shape[1]]
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(1))
    _assert_fp32_close(lib.kquant_gemv(x, wide, "Q5_K", -1), x @ dequantize(w).T)
    for dtype in (torch.bfloat16, torch.float16):
        got = quant.KQUANT.apply(quant.KQUANT.prepare(w, dtype, "cpu"), x.to(dtype), None)
        assert got.dtype == dtype
        assert torch.equal(got, lib.kquant_gemv(x.to(dtype).float(), w.data, "Q5_K", -1).to(dtype))


def test_hook_offers_kquant_only_with_the_library(monkeypatch, lib):
    monkeypatch.setattr(native, "lib", None)
    assert all(quant.quantized_linear("gguf", t) is None for t in TYPES)  # core's reference: no torch path


@pytest.mark.parametrize("path", ("default", "fp32"))
@pytest.mark.parametrize("weight_type", TYPES)
def test_tiny_kquant_gguf_greedy_equals_the_dequantized_reference(lib, tmp_path, monkeypatch, weight_type, path):
    """A tied 2-layer Llama written as a K-quant GGUF: the packed path (every linear on ``cpu-kquant-gemv``, a fused
    q/k/v of mixed types split into one kernel per part, the LM head on it too over the embedding's Q6_K blocks: no
    dense copy) and core's reference (the same blocks dequantized at load, an fp32 head) give the same greedy tokens.
    ``fp32``: a SIMD level forced, the fp32 kernels over the file's blocks, log-probabilities fp32-close. ``default``:
    on a CPU with AVX-512 VNNI the weights repacked and their decodes in two int8 terms
    (``kquant_r16.cpp``), log-probabilities within 0.05: this random model amplifies its linears' error ~3,000x (the
    fp32 kernels' rounding, ~6e-8, moves a log-probability by up to 2e-4; the two terms' 1/32512 of a block's largest
    activation by up to 0.021, measured on an AMD EPYC)."""
    if path == "fp32":
        monkeypatch.setenv("PAGEDLLM_CPU_KQUANT_ISA", {2: "avx512", 1: "avx2"}.get(lib.kquant_best_isa(), "portable"))
    r16 = path == "default" and bool(lib.kquant_r16_available())
    path = write_tied_kquant_gguf(str(tmp_path / f"tied-{weight_type}.gguf"), weight_type)
    kw = dict(device="cpu", skip_tokenizer_init=True, max_model_len=128, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=5)
    runs = {}
    for name in ("packed", "reference"):
        if name == "reference":
            monkeypatch.setattr(quant, "KQUANT_TYPES", ())  # no kernel offered: core dequantizes at load
        llm = LLM(path, **kw)
        model = llm.llm_engine.model
        layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
        assert {m.kernel_name for m in layers} == {"cpu-kquant-gemv" if name == "packed" else "reference(gguf)"}
        assert (model.lm_head_kernel[0] is quant.KQUANT.apply) == (name == "packed")
        if name == "packed":  # the head (Q6_K, 512 rows) and every part repacked, or none
            assert model.lm_head_kernel[1][5] == r16
            assert {m.state[5] for m in layers} == {r16}  # (a split's parts too)
        split = [m for m in model.modules() if isinstance(m, SplitQuantizedLinear)]  # q/k Q4_K beside a Q6_K v
        assert len(split) == (weight_type != "Q6_K")
        runs[name] = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                                         use_tqdm=False)]
        del llm
    for packed, reference in zip(runs["packed"], runs["reference"]):
        assert packed.token_ids == reference.token_ids
        for got, expected in zip(packed.logprobs, reference.logprobs):  # every step's top 5 (ties at the 5th
            common = got.keys() & expected.keys()  # may swap)
            assert len(common) >= 4
            for token in common:
                assert got[token].logprob == pytest.approx(expected[token].logprob, abs=0.05 if r16 else 5e-4)
