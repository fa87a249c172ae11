"""The Ray executor: TP=2 across two Ray nodes (two raylets on this machine, one CPU each) gives the one-rank
engine's greedy tokens and logits."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")  # an optional extra: pagedllm[ray]

from dist_utils import engine, make_dist_model, run_capturing_logits, workload  # noqa: E402
from ray_cluster import TwoNodeRay  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_across_two_ray_nodes(tmp_path, monkeypatch):
    import ray

    path = make_dist_model("llama", tmp_path)
    prompts = workload(seed=5, num=6)
    want_tokens, want_logits = run_capturing_logits(engine(path), prompts)
    cluster = TwoNodeRay()
    try:
        monkeypatch.setenv("RAY_ADDRESS", cluster.address)
        monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
        llm = engine(path, tp=2, distributed_executor_backend="ray")
        try:
            ex = llm.llm_engine.executor
            assert ex.name == "ray"
            alive = [n for n in ray.nodes() if n["Alive"]]
            assert len(alive) == 2 and all(n["Resources"].get("CPU") == 1 for n in alive)
            assert len(ex.actor_nodes) == 1 and ex.actor_nodes[0] != ex.driver_node  # rank 1 on the other node
            tokens, logits = run_capturing_logits(llm, prompts)
        finally:
            llm.llm_engine.shutdown()
            ray.shutdown()
    finally:
        cluster.stop()
    assert cluster.pids() == []
    assert tokens == want_tokens
    worst = max((a - b).abs().max().item() for a, b in zip(logits, want_logits, strict=True))
    scale = max(b.abs().max().item() for b in want_logits)
    print(f"ray TP=2: max |logit diff| = {worst:.2e} (logits up to {scale:.1f}) over {len(logits)} steps")
    assert worst <= 1e-5 * max(1.0, scale)
