"""Mixtral, Qwen2-MoE and Qwen3-MoE native vs HF (fp32, odd shapes in ``tiny_models.MOE_CONFIGS``): logits within 1e-4 through
the paged cache, every token routed to the same experts as HF (router hooks on both sides), greedy parity through the
engine, and the reference ``fused_moe`` vs the CPU backend's grouped one."""

from __future__ import annotations

import pytest
import torch

from model_parity import assert_engine_parity
from pagedllm import LLM
from pagedllm.backend import ref_ops
from pagedllm.backend.registry import get_backend
from pagedllm.models import CausalLM, load_model
from pagedllm.models.moe import SparseMoeBlock, TopKRouter
from pagedllm.errors import ParamError
from logit_parity import CHUNKED, FULL_PREFILL, assert_logits_match, family_dirs, hf_eager, parity_prompts, run_schedule
from tiny_models import MOE_CONFIGS


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    return family_dirs(tmp_path_factory, "moe_models", MOE_CONFIGS)


def _record(modules: list, pick) -> list[list]:
    """Forward hooks appending ``pick(output)`` of each module to its own list."""
    seen: list[list] = [[] for _ in modules]
    for store, m in zip(seen, modules):
        m.register_forward_hook(lambda mod, args, out, store=store: store.append(pick(out)))
    return seen


def _per_sequence(rows: list[torch.Tensor], schedule, num_seqs: int) -> list[torch.Tensor]:
    """Split each step's flat [T, k] rows back into per-sequence rows, in position order."""
    per: list[list[torch.Tensor]] = [[] for _ in range(num_seqs)]
    for step, out in zip(schedule, rows):
        start = 0
        for s, n in step:
            per[s].append(out[start:start + n])
            start += n
    return [torch.cat(p) for p in per]


@pytest.mark.parametrize("backend_name", ["ref", "cpu"])
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_logits_and_routing_match_hf(moe_dirs, ref_backend, name, backend_name):
    path = moe_dirs[name]
    backend = ref_backend if backend_name == "ref" else get_backend("cpu")
    hf = hf_eager(path)
    ours = load_model(path, backend=backend, dtype=torch.float32, device=torch.device("cpu"))
    assert isinstance(ours, CausalLM)
    sparse = [i for i, layer in enumerate(ours.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    expected_sparse = {"mixtral": [0, 1], "qwen2_moe": [0, 2], "qwen2_moe_norm": [1], "qwen3_moe": [0, 2]}[name]
    assert sparse == expected_sparse
    hf_blocks = [getattr(hf.model.layers[i], "block_sparse_moe", None) or hf.model.layers[i].mlp for i in sparse]
    hf_ids = _record([b.gate for b in hf_blocks], lambda out: out[2])  # HF routers return (logits, scores, ids)
    our_ids = _record([ours.layers[i].mlp.gate for i in sparse], lambda out: out[1])
    prompts = parity_prompts(hf.config.vocab_size)
    with torch.inference_mode():
        expected = [hf(torch.tensor([p])).logits[0] for p in prompts]
        hf_routes = [[ids[i] for i in range(len(prompts))] for ids in hf_ids]
        for schedule in (FULL_PREFILL, CHUNKED):
            for ids in our_ids:
                ids.clear()
            assert_logits_match(name, run_schedule(ours, backend, prompts, schedule), expected)
            for layer, theirs, mine in zip(sparse, hf_routes, our_ids):
                for seq, (h, o) in enumerate(zip(theirs, _per_sequence(mine, schedule, len(prompts)))):
                    assert torch.equal(h.sort(-1).values, o.sort(-1).values), \
                        f"layer {layer}, sequence {seq}: routing differs from HF"


def test_router_renormalises_as_the_config_says():
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    for renorm in (True, False):
        router = TopKRouter(8, 6, 3, renorm)
        router.weight.copy_(torch.randn(6, 8))
        weights, ids = router(x)
        probs = torch.softmax(x @ router.weight.T, dim=-1)
        top = probs.topk(3, dim=-1)
        assert torch.equal(ids, top.indices)
        want = top.values / top.values.sum(-1, keepdim=True) if renorm else top.values
        torch.testing.assert_close(weights, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 64])
def test_cpu_fused_moe_matches_reference(t, dtype):
    g = torch.Generator().manual_seed(t)
    e, k, h, i = 8, 2, 48, 40
    x = torch.randn(t, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(dtype)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=g)
    cpu = get_backend("cpu")
    assert cpu.implements("pagedllm_fused_moe"), "the CPU backend should bring its own fused_moe"
    got = cpu.fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, h)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref_ops.fused_moe(x, w13, w2, weights, ids), **tol)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_greedy_parity_engine(moe_dirs, name):
    """>= 32 greedy tokens, batch 8 of lengths 1..37 (past block 16 and window 8), chunked prefill, prefix hits."""
    path = moe_dirs[name]
    llm = assert_engine_parity(path, hf_eager(path))
    assert isinstance(llm.llm_engine.model, CausalLM)


def test_moe_refuses_lora(moe_dirs):
    with pytest.raises(ParamError, match="enable_lora.*MixtralForCausalLM"):
        LLM(moe_dirs["mixtral"], device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20,
            enable_lora=True)


def test_bench_moe_command(capsys):
    import json

    from pagedllm.cli import main

    assert main(["bench", "moe", "--tokens", "1,9", "--hidden", "32", "--intermediate", "24", "--experts", "4",
                 "--repeats", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in rows] == [1, 9]
    assert all(r["reference_ms"] > 0 and r["cpu_ms"] > 0 and r["speedup"] > 0 for r in rows)
