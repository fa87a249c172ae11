"""Shared by the GPTQ / AWQ / compressed-tensors / INT8 tests: a tiny Llama with odd-ish shapes (K = 160 and 224,
N = 32 for k/v), the HF oracle with given dense weights, and our logits through the paged cache."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from pagedllm.backend.registry import get_backend
from pagedllm.models import load_model
from pagedllm.quantization import QuantizedLinear
from logit_parity import run_schedule
from tiny_models import save_random_model

TINY = dict(model_type="llama", vocab_size=300, hidden_size=160, intermediate_size=224, num_hidden_layers=2,
            num_attention_heads=5, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
            tie_word_embeddings=False, initializer_range=0.05)
PROMPTS = [[5, 17, 201, 42, 7, 99, 3, 250, 11, 8], [200, 9, 33, 12, 77, 6]]
SCHEDULE = [[(0, 6), (1, 3)], [(0, 3), (1, 2)], [(0, 1), (1, 1)]]  # chunked prefill, then decodes


def make_dense(path) -> str:
    return save_random_model(TINY, path, seed=3)


def hf_with(dense_dir: str, weights: dict[str, torch.Tensor]):
    """HF's fp32 model of ``dense_dir`` with ``weights`` (HF names) substituted: the fake-quantized oracle."""
    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    sd = hf.state_dict()
    with torch.no_grad():
        for name, w in weights.items():
            sd[name].copy_(w)
    return hf


def logits_pair(qdir: str, method: str, hf) -> tuple[list, list, list]:
    """(ours, HF's, our QuantizedLinear modules) for the checkpoint ``qdir`` loaded with ``method`` on cpu."""
    cpu = get_backend("cpu")
    ours = load_model(qdir, backend=cpu, dtype=torch.float32, device=torch.device("cpu"), quantization=method)
    layers = [m for m in ours.modules() if isinstance(m, QuantizedLinear)]
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in PROMPTS]
        got = run_schedule(ours, cpu, PROMPTS, SCHEDULE)
    return got, expected, layers


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
