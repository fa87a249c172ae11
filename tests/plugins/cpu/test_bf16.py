"""bf16 end to end on the CPU backend: ``--dtype auto``'s choice by capability (``pagedllm_cpu/auto_dtype.py``), the
C++ ops' bf16 paths against core's pure-torch reference ops at model shapes (vectorised tails included), the paged
decode kernel on a bf16 KV cache, and greedy decoding of a bf16 checkpoint against HF transformers in bf16.

The engine's bf16 run needs a CPU with bf16 instructions (``amx_bf16`` / ``avx512_bf16``): elsewhere ``auto`` runs
float32 and that test is skipped with the reason; the float32 fallback on the same checkpoint runs everywhere.
"""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.backend import ref_ops
from pagedllm_cpu import auto_dtype, platform
from pagedllm_cpu.auto_dtype import BF16Support, resolve_auto_dtype
from test_cpu_backend import make_batch

HAS_BF16 = auto_dtype.bf16_support().native
NEEDS_BF16 = pytest.mark.skipif(not HAS_BF16, reason=f"no native bf16 here: {auto_dtype.bf16_support().why}")


# ---- --dtype auto ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False], ids=["bf16-cpu", "no-bf16-cpu"])
@pytest.mark.parametrize("checkpoint", ["bfloat16", "float16", "float32"])
def test_auto_dtype_follows_checkpoint_and_capability(native, checkpoint):
    support = BF16Support(native, "this CPU has bf16 instructions (amx_bf16)" if native else "no bf16 instructions")
    dtype, why = resolve_auto_dtype(checkpoint, None, support)
    assert dtype == ("bfloat16" if native and checkpoint != "float32" else "float32")
    assert checkpoint in why and (support.why in why or checkpoint == "float32")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("method", ["gguf", "gptq", "fp8"])
def test_auto_dtype_keeps_quantized_checkpoints_float32(native, method):
    """Quantized kernels take float32 activations (and the embedded SmolLM2 is a GGUF): auto stays float32."""
    dtype, why = resolve_auto_dtype("bfloat16", method, BF16Support(native, "x"))
    assert dtype == "float32" and method in why


def test_bf16_support_is_read_from_flags_and_onednn():
    """The real answer on this machine: native exactly when the CPU reports a bf16 instruction flag and oneDNN has
    bf16 kernels; never decided from the CPU's name."""
    flags = platform.cpu_flags()
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        first = f.read().split("\n\n")[0]
    listed = next((line.split(":", 1)[1].split() for line in first.splitlines()
                   if line.split(":")[0].strip() in ("flags", "Features")), [])
    assert flags == frozenset(listed)
    want = bool(set(auto_dtype.BF16_FLAGS) & flags) and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    support = auto_dtype.bf16_support()
    assert support.native == want
    assert platform.cpu_model() not in support.why


# ---- the C++ ops' bf16 paths against core's reference ---------------------------------------------------------------
@pytest.mark.parametrize("rows,d", [(1, 8192), (64, 1536), (3, 40), (5, 77)])  # 77, 40: vector tails
def test_silu_and_mul_bf16_is_the_reference(lib, rows, d):
    """The vectorised bf16 path rounds silu and the product exactly as the reference does: bit-identical."""
    g = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(rows, 2 * d, generator=g)).to(torch.bfloat16)
    got = lib.silu_and_mul(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref_ops.silu_and_mul(x), atol=0, rtol=0)


@pytest.mark.parametrize("heads,head_size,rot_dim", [((32, 32), 64, 64), ((9, 3), 64, 64), ((5, 1), 48, 24),
                                                     ((4, 2), 80, 80)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["cos-fp32", "cos-bf16"])
def test_rotary_bf16_is_the_reference(lib, heads, head_size, rot_dim, cache_dtype):
    g = torch.Generator().manual_seed(head_size + rot_dim)
    h, hkv = heads
    qkv = torch.randn(7, (h + 2 * hkv) * head_size, generator=g).to(torch.bfloat16)
    q, k, _ = qkv.split([h * head_size, hkv * head_size, hkv * head_size], dim=-1)
    q, k = q.view(7, h, head_size), k.view(7, hkv, head_size)  # strided views of one qkv row, as the model has
    cos_sin = torch.randn(300, rot_dim, generator=g).to(cache_dtype)
    pos = torch.tensor([0, 5, 17, 299, 3, 128, 64])
    got_q, got_k = lib.rotary(pos, q, k, cos_sin)
    want_q, want_k = ref_ops.rotary(pos, q, k, cos_sin)
    torch.testing.assert_close(got_q, want_q, atol=0, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=0, rtol=0)


@pytest.mark.parametrize("d", [2048, 576])
def test_norms_bf16_are_the_reference(lib, d):
    g = torch.Generator().manual_seed(d)
    x, res = ((3 * torch.randn(16, d, generator=g)).to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.2 * torch.randn(d, generator=g)).to(torch.bfloat16)
    torch.testing.assert_close(lib.rms_norm(x, w, 1e-5), ref_ops.rms_norm(x, w, 1e-5), atol=0, rtol=0)
    want_x = x + res
    normed = lib.fused_add_rms_norm(x, res, w, 1e-5)
    torch.testing.assert_close(x, want_x, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref_ops.rms_norm(want_x, w, 1e-5), atol=0, rtol=0)


# SmolLM2-1.7B's attention (MHA 32 heads, head 64), SmolLM2-135M's (GQA 9/3), an odd GQA; contexts that are not
# multiples of the kernel's 4-token unroll or of the block.
@pytest.mark.parametrize("heads,head_size", [((32, 32), 64), ((9, 3), 64), ((10, 2), 48), ((2, 1), 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_decode_on_bf16_kv(lib, heads, head_size, block_size):
    """The decode kernel reads the bf16 cache in place and accumulates in float32: within bf16 rounding of the
    reference (gather + float math), never reading an unwritten (NaN) slot."""
    seq_lens = [1, 2, 3, 5, 16, 17, 31, 33, 64, 97, 130]
    query, cache, meta = make_batch([1] * len(seq_lens), seq_lens, *heads, head_size, block_size, torch.bfloat16,
                                    seed=head_size + block_size)
    assert cache.dtype == torch.bfloat16
    scale = head_size ** -0.5
    out = torch.full_like(query, float("nan"))
    lib.paged_decode_attention(out, query, cache, meta.block_tables, meta.seq_lens, scale, 0, 0.0, None)
    assert not out.isnan().any()
    want = ref_ops.paged_attention(query, cache, meta, scale)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    # and against float32 attention over the same bf16 keys/values: only the output's rounding differs
    want32 = ref_ops.paged_attention(query.float(), cache.float(), meta, scale)
    torch.testing.assert_close(out.float(), want32, atol=1e-2, rtol=1e-2)


# ---- end to end ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> str:
    """The tiny Llama (GQA, head 64) stored in bf16, as most Hub checkpoints are."""
    import tiny_models
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bf16")
    path = tiny_models.make_tiny_model("llama", root / "fp32")
    AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).save_pretrained(root / "bf16")
    return str(root / "bf16")


PROMPTS = [[5, 77, 300, 12], list(range(40, 71)), [400, 3, 3, 9, 120, 256, 17]]
N = 8  # tokens generated per prompt
#: bf16 engines that sum in different orders (oneDNN's packed GEMMs and our kernels vs HF's matmuls and SDPA) agree
#: on the argmax except at near ties. The first ``EXACT`` tokens of every prompt must be HF bf16's greedy tokens, and
#: under HF bf16 teacher forcing each of our ``N`` tokens must score within ``LOGIT_TOL`` of HF's best: two bf16 ulps
#: at the tiny model's logit magnitude (|logit| 8-16, ulp 0.0625). Measured here (AMX Xeon): all 24 tokens of each
#: prompt identical to HF's, gap 0.
LOGIT_TOL = 0.125
EXACT = 4


def _generate(path: str, dtype: str):
    from pagedllm import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype=dtype, max_model_len=128, kv_cache_memory=16 << 20)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)
    resolved = llm.llm_engine.config.dtype
    llm.shutdown()
    return resolved, [o.outputs[0].token_ids for o in outs]


@NEEDS_BF16
def test_bf16_checkpoint_runs_bf16_under_auto_and_matches_hf_bf16(bf16_checkpoint, caplog):
    import hf_oracle
    from transformers import AutoModelForCausalLM

    with caplog.at_level(logging.INFO, logger="pagedllm_cpu.auto_dtype"):
        resolved, got = _generate(bf16_checkpoint, "auto")
    assert resolved == "bfloat16"
    lines = [r.getMessage() for r in caplog.records if r.name == "pagedllm_cpu.auto_dtype"]
    assert len(lines) == 1 and "dtype auto -> bfloat16" in lines[0] and "bf16 instructions" in lines[0]
    hf = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.bfloat16).eval()
    for prompt, ours in zip(PROMPTS, got):
        assert ours[:EXACT] == hf_oracle.hf_greedy(hf, prompt, EXACT)
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + ours[:-1]])).logits[0, len(prompt) - 1:].float()
        gap = logits.max(-1).values - logits.gather(-1, torch.tensor(ours).unsqueeze(-1)).squeeze(-1)
        assert float(gap.max()) <= LOGIT_TOL, (prompt, ours, gap)


def test_float32_on_a_bf16_checkpoint_matches_hf_float32(bf16_checkpoint):
    """The fallback every CPU runs (and what ``auto`` picks without bf16 instructions): exact HF float32 greedy."""
    import hf_oracle
    from transformers import AutoModelForCausalLM

    resolved, got = _generate(bf16_checkpoint, "float32")
    assert resolved == "float32"
    hf = AutoModelForCausalLM.from_pretrained(bf16_checkpoint, dtype=torch.float32).eval()
    assert got == [hf_oracle.hf_greedy(hf, p, N) for p in PROMPTS]


def test_auto_on_a_float32_checkpoint_stays_float32(caplog):
    """The tiny test models are float32 checkpoints: auto keeps them (and every HF-float32 parity test) exact."""
    from pagedllm.config import EngineConfig, resolve_config
    from pagedllm.backend.hookspec import ModelInfo
    import pagedllm.backend.registry as backends

    info = ModelInfo("LlamaForCausalLM", "float32", 2, 4, 2, 64, 512, 128)
    with caplog.at_level(logging.INFO, logger="pagedllm_cpu.auto_dtype"):
        config = resolve_config(EngineConfig(model="x"), backends.get_backend("cpu"), info)
    assert config.dtype == "float32"
    assert any("dtype auto -> float32" in r.getMessage() and "float32" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("config,want", [
    ({}, 512),  # plugin.STEP_TOKENS: steps whose activations stay under glibc's mmap threshold
    ({"max_num_batched_tokens": 8192}, 8192),  # the user's value wins
    ({"runner": "pooling"}, 2048),  # core's default: an encoder runs a prompt whole in one step
])
def test_cpu_step_budget_is_for_generation_unless_the_user_sets_one(config, want):
    from pagedllm.config import EngineConfig, resolve_config
    from pagedllm.backend.hookspec import ModelInfo
    import pagedllm.backend.registry as backends
    from pagedllm_cpu import plugin

    info = ModelInfo("LlamaForCausalLM", "float32", 2, 4, 2, 64, 512, 128)
    resolved = resolve_config(EngineConfig(model="x", **config), backends.get_backend("cpu"), info)
    assert resolved.max_num_batched_tokens == want
    assert plugin.STEP_TOKENS == 512
