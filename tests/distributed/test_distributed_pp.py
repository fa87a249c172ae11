"""Pipeline parallel (2 stages x 1 thread): layers split across ranks, hidden states sent stage to stage, two steps
of disjoint requests in flight so the second stage works on one while the first runs the next. Oracle: the one-rank
engine (same greedy tokens, same float32 logits)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import engine, make_dist_model, max_keyed_diff, run_capturing_keyed_logits, workload
from pagedllm.backend.attention import AttentionMetadata
from pagedllm.distributed.sharding import pp_layer_range
from pagedllm.executor.step import split_micro_batches


def test_layer_split_and_micro_batches():
    assert [pp_layer_range(5, 2, r) for r in range(2)] == [(0, 3), (3, 5)]
    assert [pp_layer_range(4, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    qlens, seqs = [1, 1, 30, 5, 20], [9, 4, 30, 12, 40]
    tables = [[i * 4 + j for j in range(-(-s // 16))] for i, s in enumerate(seqs)]
    meta = AttentionMetadata.build(qlens, seqs, tables, 16)
    ids, pos = torch.arange(57), torch.arange(57) * 2
    idx = [0, 1, 31, 56, 2, 3, 4]  # sampled rows, then prompt rows
    mbs, order = split_micro_batches(ids, pos, meta, idx, 2)
    assert len(mbs) == 2 and sorted(order) == list(range(len(idx)))
    t0 = 0
    for mb in mbs:  # each is a whole-sequence slice with its own consistent metadata
        n = mb.meta.num_tokens
        assert torch.equal(mb.input_ids, ids[t0:t0 + n]) and torch.equal(mb.positions, pos[t0:t0 + n])
        assert mb.meta.query_start_loc.tolist() == mb.meta.query_start_loc_cpu
        assert torch.equal(mb.meta.slot_mapping, meta.slot_mapping[t0:t0 + n])
        t0 += n
    assert t0 == 57
    rows = [j + sum(m.meta.num_tokens for m in mbs[:k]) for k, m in enumerate(mbs) for j in m.idx]
    assert [idx[o] for o in order] == rows  # logits come back in micro-batch order; order maps them home


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_pp2_tokens_and_logits_match_one_rank(tmp_path_factory, name):
    path = make_dist_model(name, tmp_path_factory.mktemp(f"pp_{name}"))
    prompts = workload(seed=3)
    want_tokens, want_logits = run_capturing_keyed_logits(engine(path), prompts)
    llm = engine(path, pp=2)
    try:
        model = llm.llm_engine.model
        assert (model.start_layer, model.end_layer, model.num_layers) == (0, 1, 1)  # rank 0 holds layer 0 only
        assert len(llm.llm_engine.kv_caches) == 1
        tokens, logits = run_capturing_keyed_logits(llm, prompts)
        ex = llm.llm_engine.executor
    finally:
        llm.llm_engine.shutdown()
    assert tokens == want_tokens
    assert ex.max_in_flight == 2  # two steps of disjoint requests in flight (test_pipeline_overlap.py)
    # Smaller batches are smaller matmuls than the one-rank step's, so float32 rounding differs in the last bits.
    worst, scale = max_keyed_diff(logits, want_logits)
    print(f"{name}: max |logit PP=2 - PP=1| = {worst:.2e} (logits up to {scale:.1f}) over {len(logits)} rows")
    assert worst <= 1e-5 * max(1.0, scale)
