"""INT8 W8A8: core's reference is compressed-tensors' own math (per-token activation fake quantization times the
int8 weight), the cpu kernel equals the reference, and SmolLM2 quantized to W8A8 by round-to-nearest keeps its
perplexity on real text within a stated bound of float32."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pagedllm import LLM
from pagedllm.backend.registry import get_backend
from pagedllm.quantization import reference_kernel
from pagedllm.quantization.int8 import quantize_weight_per_channel, w8a8_reference
from pagedllm.quantization.rtn import random_weight
from test_quantization import perplexity, zen_of_python


def test_reference_is_compressed_tensors_math():
    """Per-token activation quantization and the weight grid equal the library's ``calculate_qparams`` +
    ``fake_quantize``; the int8 matmul in float32 equals the fake-quantized float matmul."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    assert ct
    scheme = preset_name_to_scheme("W8A8", ["Linear"])
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 200, generator=gen) * 0.05
    x = torch.randn(13, 200, generator=gen) * torch.rand(13, 1, generator=gen) * 4
    w_scale, w_zero = calculate_qparams(w.amin(1, keepdim=True), w.amax(1, keepdim=True), scheme.weights)
    q, s = quantize_weight_per_channel(w)
    torch.testing.assert_close(s, w_scale, rtol=0, atol=0)
    w_fake = fake_quantize(w, w_scale, w_zero, scheme.weights)
    torch.testing.assert_close(q.float() * s, w_fake, rtol=0, atol=0)
    x_scale, x_zero = calculate_qparams(x.amin(1, keepdim=True), x.amax(1, keepdim=True), scheme.input_activations)
    want = torch.nn.functional.linear(fake_quantize(x, x_scale, x_zero, scheme.input_activations), w_fake)
    torch.testing.assert_close(w8a8_reference(x, q, s[:, 0], None), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_equals_reference(tokens, dtype):
    """The cpu ``torch._int_mm`` kernel: integer-exact, so equal to the reference up to float32 rescale rounding,
    padded (<= 16 rows) or not."""
    weight = random_weight("compressed-tensors", "W8A8", 160, 224, torch.Generator().manual_seed(1))
    cpu = get_backend("cpu")
    kernel, ref = cpu.quantized_linear("compressed-tensors", "W8A8"), reference_kernel("compressed-tensors", "W8A8")
    assert kernel.name == "cpu-int8-int_mm" and ref.name == "reference(w8a8)"
    x = torch.randn(tokens, 224, generator=torch.Generator().manual_seed(2)).to(dtype)
    bias = torch.randn(160).to(dtype)
    got = kernel.apply(kernel.prepare(weight, dtype, "cpu"), x, bias)
    want = ref.apply(ref.prepare(weight, torch.float32, "cpu"), x.float(), bias.float())
    assert got.dtype == dtype and got.shape == (tokens, 160)
    torch.testing.assert_close(got.float(), want, rtol=1e-5 if dtype == torch.float32 else 1e-2,
                               atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.slow
def test_smollm2_w8a8_perplexity_within_bound(tmp_path, smollm2_hf):
    """SmolLM2-135M (the embedded GGUF, dequantized to float32 by transformers and saved as a HF folder), every
    decoder linear made W8A8 by round-to-nearest (compressed-tensors int-quantized format): perplexity on PEP 20
    within 15% of float32, on the int8 kernel, and greedy text still right. Measured: float32 21.80, W8A8 19.29
    (-11.5%: lower, on a 203-token text the model likely memorised; the bound was set after this one measurement,
    see docs/quantization.md)."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from pagedllm.models import resolve_model_path
    from pagedllm.quantization import QuantizedLinear
    from pagedllm.quantization.rtn import quantize_folder

    path = resolve_model_path(None)
    kw = dict(gguf_file=os.path.basename(path))
    hf = smollm2_hf  # transformers' float32 dequantization of the GGUF (conftest: loaded once per session)
    # save_pretrained refuses a GGUF-loaded model: write the dense folder by hand (lm_head is tied)
    (tmp_path / "fp32").mkdir()
    save_file({k: v.contiguous() for k, v in hf.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "fp32" / "model.safetensors"), metadata={"format": "pt"})
    config = hf.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "fp32" / "config.json").write_text(json.dumps(config))
    AutoTokenizer.from_pretrained(os.path.dirname(path), **kw).save_pretrained(tmp_path / "fp32")
    quantize_folder(str(tmp_path / "fp32"), str(tmp_path / "w8a8"), "w8a8")
    engine = dict(device="cpu", max_model_len=512, kv_cache_memory=32 << 20)
    fp32 = LLM(str(tmp_path / "fp32"), **engine)
    ids = fp32.get_tokenizer().encode(zen_of_python())
    ppl_fp32 = perplexity(fp32, ids)
    del fp32
    w8 = LLM(str(tmp_path / "w8a8"), **engine)
    layers = [m for m in w8.llm_engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * 30 and {m.kernel_name for m in layers} == {"cpu-int8-int_mm"}
    ppl_w8 = perplexity(w8, ids)
    print(f"SmolLM2 perplexity on PEP 20 ({len(ids)} tokens): float32 {ppl_fp32:.3f}, W8A8 {ppl_w8:.3f} "
          f"({ppl_w8 / ppl_fp32 - 1:+.2%})")
    assert abs(ppl_w8 / ppl_fp32 - 1) < 0.15
    from pagedllm import SamplingParams
    out = w8.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
