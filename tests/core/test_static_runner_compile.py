"""core's StaticGraphRunner under ``torch.compile(dynamic=False)``: every bucket compiles once, into a cache of its
own, so more buckets than torch's recompile limit (8) never recompile and never fall back to eager."""

from __future__ import annotations

import torch
import torch._dynamo
from torch._dynamo.utils import counters

from pagedllm.backend import (BucketPolicy, RunnerContext, SamplingTensors, StaticGraphRunner, dummy_metadata,
                              ModelInfo)
from pagedllm.config import EngineConfig

VOCAB, HIDDEN, BLOCK = 32, 8, 16


class TinyModel(torch.nn.Module):
    """The model interface a runner drives: ``forward(ids, positions, meta)`` and ``compute_logits``."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, positions, meta):
        return self.embed(ids) + positions[:, None] + meta.slot_mapping[:, None]

    def compute_logits(self, hidden):
        return self.head(hidden)


def test_more_buckets_than_the_recompile_limit_compile_once_each():
    policy = BucketPolicy(tuple(range(1, 13)), (1,), (1,), block_size=BLOCK)  # 12 shapes, one per token count
    shapes = policy.warmup_shapes()
    assert len(shapes) > torch._dynamo.config.recompile_limit
    ctx = RunnerContext(EngineConfig(), ModelInfo("Tiny", "float32", 1, 1, 1, HIDDEN, VOCAB, 64), 64, BLOCK, 1, 12,
                        torch.float32, torch.device("cpu"), policy)
    runner = StaticGraphRunner(TinyModel(), ctx, lambda fn: torch.compile(fn, backend="eager", dynamic=False,
                                                                          fullgraph=True))
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(error_on_recompile=True), torch.inference_mode():
        for _ in range(2):  # capture, then replay
            for shape in shapes:
                meta = dummy_metadata(shape, BLOCK, torch.device("cpu"), pad_slot=0, block=0)
                ids, positions = torch.ones(shape.num_tokens, dtype=torch.long), torch.arange(shape.num_tokens)
                hidden = runner.run(ids, positions, meta)
                assert torch.equal(hidden, runner.model(ids, positions, meta))
                rows = torch.zeros(shape.num_seqs, dtype=torch.long)
                runner.sample(ids, positions, meta, rows, SamplingTensors.build([], shape.num_seqs, ctx.device))
    assert runner.stats["captures"] == 2 * len(shapes) == runner.stats["replays"]
    assert counters["stats"]["unique_graphs"] == 2 * len(shapes)  # one compile per program and bucket, no more
