"""What the vision-language model tests share (tests/models/test_llava.py, test_smolvlm.py, test_qwen_vl.py):
deterministic PIL images, their engine and HF fixtures, greedy parameters, and the checks against HF (greedy tokens
with every prompt and output log-probability, the decoder's logits on a text prompt)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from pagedllm import LLM, SamplingParams

BLOCK = 16


def image(h: int, w: int, seed: int) -> Image.Image:
    """A deterministic RGB image of ``h x w`` (smooth gradients plus noise, so crops and resizes differ)."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 97) % 256], -1)
    return Image.fromarray(((base + rng.randint(0, 60, (h, w, 3))) % 256).astype(np.uint8))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def hf_fixture(model_class: str):
    """A module fixture: (HF's float32 ``model_class`` in eval mode, its PIL-backed processor) for ``model_path``."""
    @pytest.fixture(scope="module")
    def hf(model_path):
        import transformers

        model = getattr(transformers, model_class).from_pretrained(model_path, dtype=torch.float32).eval()
        return model, transformers.AutoProcessor.from_pretrained(model_path, backend="pil")
    return hf


def engine_fixture(num_blocks: int):
    """A module fixture: an engine on ``model_path`` whose 24-token steps split every image across steps."""
    @pytest.fixture(scope="module")
    def llm(model_path):
        with LLM(model_path, device="cpu", dtype="float32", block_size=BLOCK, max_num_batched_tokens=24,
                 max_num_seqs=4, num_gpu_blocks_override=num_blocks) as engine:
            yield engine
    return llm


def hf_generate(model, inputs, n: int) -> list[int]:
    """HF's ``n`` greedy tokens after the processed prompt."""
    return model.generate(**inputs, max_new_tokens=n, do_sample=False)[0, inputs["input_ids"].shape[1]:].tolist()


def hf_logprobs(model, inputs, tokens: list[int]) -> torch.Tensor:
    """HF's log-probability of each token of ``tokens`` (the processed prompt plus the generated ones) given those
    before it, under the same pixel values (and pixel attention mask, where the processor gives one)."""
    ids = torch.tensor([tokens])
    pixels = {k: inputs[k] for k in ("pixel_values", "pixel_attention_mask") if k in inputs}
    with torch.no_grad():
        logits = model(input_ids=ids, **pixels).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return lp[torch.arange(len(tokens) - 1), ids[0, 1:]]


def assert_greedy_and_logprobs_match(llm: LLM, model, inputs, prompt: str, images: list, n: int) -> list[float]:
    """The engine's prompt token ids and ``n`` greedy tokens are HF's, and every prompt and output log-probability
    is within 1e-4 of HF's forward; returns the prompt log-probabilities."""
    want = hf_generate(model, inputs, n)
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": list(images)}},
                       greedy(n, logprobs=0, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == want
    ref = hf_logprobs(model, inputs, out.prompt_token_ids + want)
    prompt_lp = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    out_lp = [d[t].logprob for d, t in zip(out.outputs[0].logprobs, want)]
    torch.testing.assert_close(torch.tensor(prompt_lp + out_lp), ref, atol=1e-4, rtol=1e-4)
    return prompt_lp


def assert_text_logits_match(ours, theirs, ids: list[int]) -> None:
    """The decoder's logits on a text prompt (the mapped text weights) as HF's, through the CPU backend's cache."""
    from pagedllm.backend.attention import AttentionMetadata
    from pagedllm.backend.hookspec import KVCacheSpec
    from pagedllm.backend.registry import get_backend

    with torch.no_grad():
        ref = theirs(input_ids=torch.tensor([ids])).logits[0]
    ours.kv_caches = get_backend("cpu").allocate_kv_cache(KVCacheSpec(ours.num_layers, 2, 16, ours.num_kv_heads,
                                                                      ours.head_size, torch.float32,
                                                                      torch.device("cpu")))
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [[1]], 16)
    with torch.inference_mode():
        logits = ours.compute_logits(ours(torch.tensor(ids), torch.arange(len(ids)), meta))
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
