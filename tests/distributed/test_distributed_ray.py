"""The Ray executor: TP=2 and PP=2 (two steps in flight) across two Ray nodes (two raylets on this machine, one CPU
each) give the one-rank engine's greedy tokens and logits."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")  # an optional extra: pagedllm[ray]

from dist_utils import (engine, make_dist_model, max_keyed_diff, run_capturing_keyed_logits,  # noqa: E402
                        run_capturing_logits, workload)
from ray_cluster import TwoNodeRay  # noqa: E402


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_and_pp2_across_two_ray_nodes(tmp_path, monkeypatch):
    import ray

    path = make_dist_model("llama", tmp_path)
    prompts = workload(seed=5, num=6)
    want_tokens, want_logits = run_capturing_logits(engine(path), prompts)
    pp_want_tokens, pp_want_logits = run_capturing_keyed_logits(engine(path), prompts)
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
        llm = engine(path, pp=2, distributed_executor_backend="ray")  # the same cluster: rank 1 holds layer 1
        try:
            ex = llm.llm_engine.executor
            assert ex.name == "ray" and len(ex.actor_nodes) == 1 and ex.actor_nodes[0] != ex.driver_node
            pp_tokens, pp_logits = run_capturing_keyed_logits(llm, prompts)
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
    assert pp_tokens == pp_want_tokens
    assert ex.max_in_flight == 2  # two steps of disjoint requests in flight, as with the mp executor
    worst, scale = max_keyed_diff(pp_logits, pp_want_logits)
    print(f"ray PP=2: max |logit diff| = {worst:.2e} (logits up to {scale:.1f}) over {len(pp_logits)} rows")
    assert worst <= 1e-5 * max(1.0, scale)
