"""Warm-up hands a graph runner what a real step hands it: separate tensors, never one tensor for two inputs (a
compiled graph guards on input aliasing, so an aliased warm-up would recompile every bucket at the first step), and
metadata a real padded step could have."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.backend import BucketPolicy, Capabilities, GraphRunner
from pagedllm.backend.registry import register_backend
from plugin_factory import REFERENCE_FEATURES, make_plugin


@pytest.fixture(scope="module")
def warmup_calls(tiny_llama) -> tuple[list, list]:
    """Every warm-up call of a bucketed backend's graph runner: (kind, tensors...) and the run calls' metadata."""
    calls: list = []
    metas: list = []

    def batch_policy(ctx):
        return BucketPolicy((8, 64), (1, 2), (1, 8), block_size=ctx.block_size)  # (64, 1, 1): 48 padding rows

    def graph_runner(model, max_num_seqs, device, ctx):
        def run(input_ids, positions, meta):
            calls.append(("run", input_ids, positions))
            metas.append(meta)
            return model(input_ids, positions, meta)

        def sample(input_ids, positions, meta, logits_indices, tensors):
            calls.append(("sample", input_ids, positions, logits_indices))
            return logits_indices

        return GraphRunner(run=run, level="full", sample=sample)

    caps = Capabilities(head_sizes=None, graph_capture="full", on_device_sampling=True, **REFERENCE_FEATURES)
    name = "warmup-probe"
    register_backend(make_plugin(name, caps, batch_policy=batch_policy, graph_runner=graph_runner), name)
    llm = LLM(tiny_llama, device=name, dtype="float32", max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=64, num_gpu_blocks_override=16, skip_tokenizer_init=True)
    assert len(calls) == 2 * len(llm.llm_engine.worker.policy.warmup_shapes()) > 0
    return calls, metas


def test_warmup_inputs_never_alias(warmup_calls):
    for kind, *tensors in warmup_calls[0]:
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors), kind


def test_warmup_sequences_fit_their_block_tables(warmup_calls):
    """A bucket may hold more tokens than its sequences' block tables: the rest are padding rows, as in a real step
    (core's reference attention reads each sequence through its block table)."""
    for meta in warmup_calls[1]:
        width = meta.block_tables.shape[1] * meta.block_size
        assert max(meta.seq_lens_cpu) <= width, (meta.seq_lens_cpu, width)
        assert meta.query_start_loc_cpu[-1] <= meta.slot_mapping.shape[0]
    assert any(m.query_start_loc_cpu[-1] < m.slot_mapping.shape[0] for m in warmup_calls[1])  # padding rows ran
