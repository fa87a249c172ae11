"""Warm-up hands a graph runner what a real step hands it: separate tensors, never one tensor for two inputs (a
compiled graph guards on input aliasing, so an aliased warm-up would recompile every bucket at the first step)."""

from __future__ import annotations

from pagedllm import LLM
from pagedllm.backend import BucketPolicy, Capabilities, GraphRunner
from pagedllm.backend.registry import register_backend
from plugin_factory import REFERENCE_FEATURES, make_plugin


def test_warmup_inputs_never_alias(tiny_llama):
    calls: list = []

    def batch_policy(ctx):
        return BucketPolicy((8, 16), (1, 2), (8,), block_size=ctx.block_size)

    def graph_runner(model, max_num_seqs, device, ctx):
        def run(input_ids, positions, meta):
            calls.append(("run", input_ids, positions))
            return model(input_ids, positions, meta)

        def sample(input_ids, positions, meta, logits_indices, tensors):
            calls.append(("sample", input_ids, positions, logits_indices))
            return logits_indices

        return GraphRunner(run=run, level="full", sample=sample)

    caps = Capabilities(head_sizes=None, graph_capture="full", on_device_sampling=True, **REFERENCE_FEATURES)
    name = "aliasing-probe"
    register_backend(make_plugin(name, caps, batch_policy=batch_policy, graph_runner=graph_runner), name)
    llm = LLM(tiny_llama, device=name, dtype="float32", max_model_len=128, max_num_seqs=2,
              max_num_batched_tokens=16, num_gpu_blocks_override=16, skip_tokenizer_init=True)
    warm = llm.llm_engine.worker.policy.warmup_shapes()
    assert len(calls) == 2 * len(warm) > 0
    for kind, *tensors in calls:
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(tensors), kind
