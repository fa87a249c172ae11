"""DeepSeek-V2/V3 natively (``tiny_models.DEEPSEEK_CONFIGS``) vs HF: MLA attention with the compressed latent in the
paged cache, grouped top-k routing, shared experts, ``first_k_dense_replace``, YaRN mscale. fp32 logits within 1e-4,
greedy parity through the engine (CPU backend), routing of every token equal to HF's, and KV memory per token equal
to the latent size, read from the allocator."""

from __future__ import annotations

import pytest
import torch

from model_parity import assert_engine_parity
from pagedllm.models import CausalLM, load_model
from pagedllm.models.mla import MLAAttention
from pagedllm.models.moe import DeepseekMoeBlock
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, family_dirs, hf_eager, parity_prompts, run_schedule
from tiny_models import DEEPSEEK_CONFIGS

NAMES = list(DEEPSEEK_CONFIGS)


@pytest.fixture(scope="module")
def deepseek_dirs(tmp_path_factory) -> dict[str, str]:
    return family_dirs(tmp_path_factory, "deepseek", NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_deepseek_logits_match_hf(deepseek_dirs, ref_backend, name):
    path = deepseek_dirs[name]
    hf = hf_eager(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours.layers[0].self_attn, MLAAttention)
    assert not isinstance(ours.layers[0].mlp, DeepseekMoeBlock)  # first_k_dense_replace = 1
    assert all(isinstance(layer.mlp, DeepseekMoeBlock) for layer in ours.layers[1:])
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        for schedule in (FULL_PREFILL, CHUNKED):
            assert_logits_match(name, run_schedule(ours, ref_backend, prompts, schedule), expected)


@pytest.mark.parametrize("name", NAMES)
def test_deepseek_routing_equals_hf(deepseek_dirs, ref_backend, name):
    """Every token of every MoE layer: the same experts and the same (scaled) weights as HF's router, fed the hidden
    states HF's own forward routes."""
    path = deepseek_dirs[name]
    hf = hf_eager(path)
    ours = load_model(path, backend=ref_backend, dtype=torch.float32, device=torch.device("cpu"))
    seen: dict[int, tuple] = {}

    def capture(i):
        def hook(mod, args, out) -> None:
            seen[i] = (args[0].reshape(-1, args[0].shape[-1]), out)
        return hook

    hooks = [layer.mlp.gate.register_forward_hook(capture(i)) for i, layer in enumerate(hf.model.layers)
             if hasattr(layer.mlp, "gate")]
    prompt = [(11 * i) % 480 + 3 for i in range(41)]
    with torch.inference_mode():
        hf(torch.tensor([prompt]))
        for h in hooks:
            h.remove()
        assert sorted(seen) == [1, 2]
        for i, (x, (_, hf_weights, hf_ids)) in seen.items():
            weights, ids = ours.layers[i].mlp.gate(x)
            order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)
            assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order)), f"layer {i}: experts differ"
            torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order).float(),
                                       rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_greedy_parity_engine_and_latent_kv(deepseek_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16), chunked prefill, prefix hits; the pool the
    allocator built holds one latent row (kv_lora_rank + qk_rope_head_dim) per token and layer, not expanded K/V."""
    path = deepseek_dirs[name]
    hf = hf_eager(path)
    llm = assert_engine_parity(path, hf)
    engine = llm.llm_engine
    assert isinstance(engine.model, CausalLM)
    c = hf.config
    latent = c.kv_lora_rank + c.qk_rope_head_dim  # 56
    worker = engine.worker
    spec = worker._kv_spec(1)
    assert spec.mla and (spec.num_kv_heads, spec.head_size) == (1, latent)
    per_token = spec.bytes_per_block // spec.block_size
    assert per_token == c.num_hidden_layers * latent * 4
    expanded = c.num_hidden_layers * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim) * 4
    assert per_token * 10 < expanded  # 672 B vs 7200 B per token here (3 layers, 10 heads)
    allocated = sum(t.nbytes for t in worker.kv_caches)
    assert allocated == worker.num_blocks * spec.bytes_per_block
    assert all(tuple(t.shape) == (1, worker.num_blocks, 16, 1, latent) for t in worker.kv_caches)
