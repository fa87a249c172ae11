"""The CPU plugin's batched path for GGUF block-quantized linears (``kquant_mm_bf16`` in
``pagedllm_cpu/csrc/kquant_gemv.cpp``: a panel of the weights decoded to bf16 per call, the GEMM on oneDNN) against
core's reference (``gguf.quants`` dequantization, fp32 matmul) within bf16's tolerance, for Q4_K / Q5_K / Q6_K /
Q8_0 (the file's rows) and Q4_0 / Q4_1 (``q4_gemv``'s repacked layout); the hook's choice between it and the fp32
kernels (threshold, forced SIMD level, override, CPUs without bf16 dot products); no persistent dequantized copy;
and greedy tokens of a tiny K-quant GGUF through it equal to the dequantized reference's."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.backend.hookspec import QuantizedWeight
from pagedllm.quantization import QuantizedLinear, dequantize
from pagedllm.quantization.gguf import random_blocks
from pagedllm_cpu import quant

ROW_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")  # read as the file's rows
REPACKED_TYPES = ("Q4_0", "Q4_1")  # read in q4_gemv's layout
#: bf16 rounds the activations, the weights and the result (2^-9 relative each, fp32 sums inside oneDNN): measured
#: <= 5e-3 of the largest output on these shapes; the fp32 kernels' 2e-5 would not hold.
BF16_TOL = 1e-2


@pytest.fixture(autouse=True)
def fp32_activations(monkeypatch):
    """Few-row calls here are the fp32 kernel's (``PAGEDLLM_CPU_INT8_ACT=0``; int8 activations:
    test_kquant_q8k.py)."""
    monkeypatch.setenv("PAGEDLLM_CPU_INT8_ACT", "0")


def _weight(weight_type: str, n: int, k: int) -> QuantizedWeight:
    blocks = random_blocks(weight_type, n, k, np.random.default_rng(n * k))
    return QuantizedWeight("gguf", weight_type, torch.from_numpy(blocks), (n, k))


def _assert_bf16_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=BF16_TOL * expected.abs().max().item())


def _run(lib, w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    n = w.shape[0]
    if w.weight_type in REPACKED_TYPES:
        return lib.kquant_mm_bf16(x, quant._repack(w), w.weight_type, n)
    return lib.kquant_mm_bf16(x, w.data.reshape(n, -1), w.weight_type)


@pytest.mark.parametrize("weight_type", ROW_TYPES + REPACKED_TYPES)
@pytest.mark.parametrize("n,k", [(37, 256), (70, 1280), (600, 8192)])  # N % 16 != 0; 600 x 8192: two panels
def test_bf16_gemm_matches_the_reference(lib, weight_type, n, k):
    w = _weight(weight_type, n, k)
    dense = dequantize(w)
    for rows in ((1, 16, 64) if n < 600 else (16,)):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
        got = _run(lib, w, x)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        _assert_bf16_close(got, x @ dense.T)


def test_bf16_gemm_shapes_dtypes_and_errors(lib):
    """Leading dimensions kept, bf16 activations give bf16 (fp16: fp16), strided rows read with their stride, and
    bad input named."""
    w = _weight("Q6_K", 21, 512)
    dense = dequantize(w)
    x = torch.randn(2, 9, 512, generator=torch.Generator().manual_seed(3))
    got = lib.kquant_mm_bf16(x, w.data.reshape(21, -1), "Q6_K")
    assert got.shape == (2, 9, 21)
    _assert_bf16_close(got, x @ dense.T)
    for dtype in (torch.bfloat16, torch.float16):
        y = lib.kquant_mm_bf16(x.to(dtype), w.data.reshape(21, -1), "Q6_K")
        assert y.dtype == dtype
        _assert_bf16_close(y, x @ dense.T)
    wide = torch.cat([w.data.reshape(21, -1), torch.full((21, 7), 0xFF, dtype=torch.uint8)], 1)[:, :2 * 210]
    _assert_bf16_close(lib.kquant_mm_bf16(x, wide, "Q6_K"), x @ dense.T)
    with pytest.raises(RuntimeError, match=r"weight_type must be Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, Q4_1 or Q\{4,5,6\}_K_R16, got IQ2"):
        lib.kquant_mm_bf16(x, w.data.reshape(21, -1), "IQ2")
    with pytest.raises(RuntimeError, match=r"blocks must be uint8 \[N, K / 256 \* 210\]"):
        lib.kquant_mm_bf16(torch.zeros(1, 256), w.data.reshape(21, -1), "Q6_K")
    with pytest.raises(RuntimeError, match=r"Q4_1 blocks must be q4_gemv's uint8 \[ceil\(N / 16\), K / 32, 320\]"):
        lib.kquant_mm_bf16(torch.zeros(1, 512), quant._repack(_weight("Q4_1", 20, 256)), "Q4_1", 20)


def _bf16_cpu() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split())
    return {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"} <= flags


@pytest.fixture
def fresh_threshold(monkeypatch):
    """``quant.bf16_min_rows`` reads its environment once per process: undone around each test."""
    monkeypatch.setattr(quant, "_bf16_config", None)
    yield monkeypatch


def test_threshold_follows_the_cpu_the_dtype_and_the_override(lib, fresh_threshold):
    """On CPUs with bf16 dot products, bf16 models take the GEMM from ``BF16_MIN_ROWS`` rows, float32 models from
    ``FLOAT32_GEMM_MIN_ROWS`` (prefill chunks; decodes keep the fp32 kernels), float16 ones never; AVX2-only /
    portable CPUs keep the fp32 kernels (exact to summation order); ``PAGEDLLM_CPU_KQUANT_BF16_ROWS`` sets the
    threshold for every dtype or turns it off, a misspelt value names the variable."""
    assert bool(lib.kquant_has_bf16()) == _bf16_cpu()
    assert quant.bf16_min_rows(torch.bfloat16) == (quant.BF16_MIN_ROWS if _bf16_cpu() else None)
    assert quant.bf16_min_rows(torch.float32) == (quant.FLOAT32_GEMM_MIN_ROWS if _bf16_cpu() else None)
    assert quant.bf16_min_rows(torch.float16) is None
    for value, expected in (("off", None), ("3", 3)):
        fresh_threshold.setattr(quant, "_bf16_config", None)
        fresh_threshold.setenv("PAGEDLLM_CPU_KQUANT_BF16_ROWS", value)
        assert quant.bf16_min_rows(torch.float32) == quant.bf16_min_rows(torch.bfloat16) == expected
    fresh_threshold.setattr(quant, "_bf16_config", None)
    fresh_threshold.setenv("PAGEDLLM_CPU_KQUANT_BF16_ROWS", "many")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_KQUANT_BF16_ROWS='many'"):
        quant.bf16_min_rows(torch.float32)


def test_bf16_model_takes_the_gemm_by_default_where_the_cpu_has_bf16(lib, fresh_threshold):
    w = _weight("Q6_K", 40, 512)
    state = quant.KQUANT.prepare(w, torch.bfloat16, "cpu")
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(2)).bfloat16()
    fp32_kernel = lib.kquant_gemv(x, w.data, "Q6_K", -1)
    if _bf16_cpu():
        assert state[3] == quant.BF16_MIN_ROWS == 16
        assert torch.equal(quant.KQUANT.apply(state, x, None), _run(lib, w, x))
        assert torch.equal(quant.KQUANT.apply(state, x[:15], None), fp32_kernel[:15])
    else:
        assert state[3] is None
        assert torch.equal(quant.KQUANT.apply(state, x, None), fp32_kernel)
    q4 = quant.Q4.prepare(_weight("Q4_1", 40, 512), torch.bfloat16, "cpu")  # scalar decode: a later crossover
    assert q4.bf16_rows == (quant.BF16_MIN_ROWS_Q4 if _bf16_cpu() else None)
    q4_fp32 = quant.Q4.prepare(_weight("Q4_1", 40, 512), torch.float32, "cpu")
    assert q4_fp32.bf16_rows == (quant.FLOAT32_GEMM_MIN_ROWS if _bf16_cpu() else None)


@pytest.mark.parametrize("weight_type", ("Q4_K", "Q8_0", "Q4_1"))
def test_float32_model_prefills_on_the_gemm_and_decodes_exact(lib, fresh_threshold, weight_type):
    """A float32 model (GGUF under ``dtype=auto``) on a CPU with bf16 dot products: a call of
    ``FLOAT32_GEMM_MIN_ROWS`` rows (a prefill chunk) is the bf16 GEMM, within bf16's rounding of the dequantized
    reference; one row fewer (a batch of decodes) is the fp32 kernel, exact to summation order."""
    kernel = quant.quantized_linear("gguf", weight_type)
    w = _weight(weight_type, 40, 512)
    state = kernel.prepare(w, torch.float32, "cpu")
    rows = quant.FLOAT32_GEMM_MIN_ROWS
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(3))
    reference = torch.nn.functional.linear(x, dequantize(w))
    prefill, decode = kernel.apply(state, x, None), kernel.apply(state, x[: rows - 1], None)
    assert prefill.dtype == decode.dtype == torch.float32
    torch.testing.assert_close(decode, reference[: rows - 1], rtol=2e-5, atol=2e-5 * reference.abs().max().item())
    if _bf16_cpu():
        assert torch.equal(prefill, _run(lib, w, x))
        _assert_bf16_close(prefill, reference)
        assert not torch.equal(prefill[: rows - 1], decode)
    else:
        torch.testing.assert_close(prefill, reference, rtol=2e-5, atol=2e-5 * reference.abs().max().item())


@pytest.mark.parametrize("weight_type", ("Q4_K", "Q8_0", "Q4_1"))
def test_hook_takes_the_gemm_from_the_threshold(lib, fresh_threshold, weight_type):
    """Below the threshold the hook runs the fp32 kernel, from it the bf16 GEMM (bias added either way), for a float32
    model too when the override asks; a SIMD level forced with ``PAGEDLLM_CPU_KQUANT_ISA`` keeps K-quants on that
    level's fp32 kernel."""
    fresh_threshold.setenv("PAGEDLLM_CPU_KQUANT_BF16_ROWS", "6")
    w = _weight(weight_type, 40, 512)
    kernel = quant.quantized_linear("gguf", weight_type)
    state = kernel.prepare(w, torch.float32, "cpu")
    bias = torch.randn(40, generator=torch.Generator().manual_seed(40))
    for rows in (5, 6, 30):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        got = kernel.apply(state, x, bias)
        bf16 = _run(lib, w, x) + bias
        if rows < 6:
            fp32 = torch.nn.functional.linear(x, dequantize(w), bias)
            torch.testing.assert_close(got, fp32, rtol=2e-5, atol=2e-5 * fp32.abs().max().item())
            assert not torch.equal(got, bf16)
        else:
            assert torch.equal(got, bf16)
    if weight_type == "Q4_K":
        fresh_threshold.setenv("PAGEDLLM_CPU_KQUANT_ISA", "avx2" if lib.kquant_best_isa() >= 1 else "portable")
        forced = quant.KQUANT.prepare(w, torch.float32, "cpu")
        assert forced[3] is None
        x = torch.randn(30, 512, generator=torch.Generator().manual_seed(30))
        assert torch.equal(quant.KQUANT.apply(forced, x, None), lib.kquant_gemv(x, w.data, "Q4_K", forced[2]))


def test_no_persistent_dequantized_copy(lib, fresh_threshold):
    """Batched calls on a 8192 x 2048 Q4_K weight (9 MiB of blocks; 32 MiB as bf16, 64 MiB as fp32) keep nothing:
    the process's memory does not grow from call to call, and one call holds at most its panel (8 MiB) and the
    activations."""
    fresh_threshold.setenv("PAGEDLLM_CPU_KQUANT_BF16_ROWS", "1")
    w = _weight("Q4_K", 8192, 2048)
    state = quant.KQUANT.prepare(w, torch.float32, "cpu")
    x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(0))
    proc = psutil.Process()
    quant.KQUANT.apply(state, x, None)
    gc.collect()
    first = proc.memory_info().rss
    for _ in range(4):
        y = quant.KQUANT.apply(state, x, None)
    del y
    gc.collect()
    assert proc.memory_info().rss - first < 12 << 20, "memory grew across calls: a copy is kept"
    if state[5]:  # repacked at load (AVX-512 VNNI): the 16-row layout's bytes, 148 a row per super-block for 144
        assert state[0].numel() == w.data.numel() * 148 // 144
    else:  # the blocks as given
        assert state[0].data_ptr() == w.data.data_ptr()


def _write_kquant_gguf(path: str) -> str:
    """A tied 2-layer Llama in a Q4_K_M-like layout (q/k/o/gate/up Q4_K, v/down Q6_K, the embedding / LM head
    Q6_K), random valid blocks with centred Q4_K weights so the greedy tokens vary."""
    import gguf
    from gguf_utils import add_model_header, finish

    c = SimpleNamespace(max_position_embeddings=128, hidden_size=256, num_hidden_layers=2, intermediate_size=512,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, bos_token_id=1, eos_token_id=2)
    w = gguf.GGUFWriter(path, "llama")
    add_model_header(w, c)
    w.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(1)

    def blocks(name: str, qtype: str, n: int, k: int) -> None:
        raw = random_blocks(qtype, n, k, rng)
        if qtype == "Q4_K":  # min = scale, dmin = 7.5 d: weights centred on 0
            sb = raw.reshape(n, k // 256, -1)
            sb[..., 8:12] = (sb[..., 8:12] & 0x0F) | (sb[..., 8:12] << 4)
            sb[..., 4:8] = sb[..., 0:4]
            sb[..., 2:4] = (sb[..., 0:2].copy().view(np.float16) * np.float16(7.5)).view(np.uint8)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])

    blocks("token_embd.weight", "Q6_K", c.vocab_size, c.hidden_size)
    w.add_tensor("output_norm.weight", np.ones(c.hidden_size, np.float32))
    kv = c.hidden_size // c.num_attention_heads * c.num_key_value_heads
    for i in range(c.num_hidden_layers):
        for name, n, k in [("attn_q", 256, 256), ("attn_k", kv, 256), ("attn_v", kv, 256), ("attn_output", 256, 256),
                           ("ffn_gate", 512, 256), ("ffn_up", 512, 256), ("ffn_down", 256, 512)]:
            blocks(f"blk.{i}.{name}.weight", "Q6_K" if name in ("attn_v", "ffn_down") else "Q4_K", n, k)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(c.hidden_size, np.float32))
    return finish(w, path)


@pytest.mark.slow
def test_tiny_kquant_gguf_greedy_through_the_gemm_equals_the_reference(lib, tmp_path, fresh_threshold):
    """Every linear and the tied LM head on the bf16 GEMM (threshold 1: prefill and each decode step) gives the
    dequantized reference's greedy tokens (core dequantizes at load, fp32) for the first 8 tokens of each prompt."""
    path = _write_kquant_gguf(str(tmp_path / "tiny-q4_k_m.gguf"))
    prompts = [[int(t) for t in np.random.default_rng(s).integers(3, 512, 40)] for s in range(3)]
    kw = dict(device="cpu", skip_tokenizer_init=True, max_model_len=128, kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs, choices = {}, []
    choose = quant._batched_bf16
    fresh_threshold.setattr(quant, "_batched_bf16", lambda x, rows: choices.append(choose(x, rows)) or choices[-1])
    for name in ("gemm", "reference"):
        fresh_threshold.setattr(quant, "_bf16_config", None)
        if name == "reference":
            fresh_threshold.setattr(quant, "KQUANT_TYPES", ())  # no kernel offered: core dequantizes at load
        else:
            fresh_threshold.setenv("PAGEDLLM_CPU_KQUANT_BF16_ROWS", "1")
        llm = LLM(path, **kw)
        kernels = {m.kernel_name for m in llm.llm_engine.model.modules() if isinstance(m, QuantizedLinear)}
        assert kernels == {"cpu-kquant-gemv" if name == "gemm" else "reference(gguf)"}
        runs[name] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   params, use_tqdm=False)]
        del llm
    assert choices and all(choices)  # every packed call (prefill and decode, linears and head) took the GEMM
    assert runs["gemm"] == runs["reference"]
