"""Helpers for the distributed tests: tiny models with the shapes TP must handle, mixed workloads, logits capture."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file
from torch import nn

import tiny_models
from pagedllm import LLM, SamplingParams

# Odd shapes on purpose: a vocabulary two ranks do not divide (509), and one kv head for two ranks (replicated).
DIST_MODELS = {"llama": ("llama", dict(vocab_size=509)), "qwen3": ("qwen3", dict(num_key_value_heads=1))}


def make_dist_model(name: str, root) -> str:
    arch, over = DIST_MODELS[name]
    path = os.path.join(str(root), name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        tiny_models.make_tiny_model(arch, path, **over)
    return path


def workload(seed: int = 1, num: int = 10) -> list[list[int]]:
    """Mixed lengths: decodes batched with chunked prefills at a 48-token budget."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 90, (num,), generator=g).tolist()
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in lens]


def prefix_workload(prompts: list[list[int]]) -> list[list[int]]:
    """Prompts that share their first 48 tokens with the longest of ``prompts`` (prefix-cache hits when run after
    them)."""
    longest = max(prompts, key=len)
    return [longest[:48] + [7, 8, 9], longest[:48] + [10, 11]]


def engine(path: str, tp: int = 1, pp: int = 1, **kw) -> LLM:
    return LLM(path, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks_override=128,
               max_num_batched_tokens=48, max_num_seqs=8, enable_prefix_caching=True, skip_tokenizer_init=True,
               tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw)


def _generate_workload(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    """Greedy ``prompts`` with prompt logprobs (every prompt position's logits), then prompts that hit the prefix
    cache; no KV block may stay used."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=1),
                        use_tqdm=False)
    outs += llm.generate([{"prompt_token_ids": p} for p in prefix_workload(prompts)],
                         SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    assert llm.llm_engine.kv.num_used_blocks == 0, "KV blocks leaked"
    return outs


def run_capturing_logits(llm: LLM, prompts: list[list[int]], max_tokens: int = 6):
    """Greedy outputs, and every step's float32 logits as the driver's runner received them."""
    runner = llm.llm_engine.worker.runner
    inner, logits = runner.forward_logits, []

    def capture(*args):
        out = inner(*args)
        if out is not None:
            logits.append(out.clone())
        return out

    runner.forward_logits = capture
    try:
        outs = _generate_workload(llm, prompts, max_tokens)
    finally:
        runner.forward_logits = inner
    return [o.outputs[0].token_ids for o in outs], logits


# What TP=2 must reproduce: TP=1 vs TP=2 logits differ only by float32 summation order (docs/distributed.md).
TP_LOGITS_ABS = 5e-5  # measured up to 3.2e-5 (tiny Llama), 1.3e-5 (tiny Qwen3) over 8 workloads
TP_LOGITS_REL = 5e-6  # of the largest |logit| of the run: measured up to 3.0e-6 (Llama), 1.6e-6 (Qwen3)


class RowSplitLinear(nn.Module):
    """A row-parallel split done in one process: the weight's input columns in ``tp`` equal parts, each part's
    product on ``kernel`` (the backend's dense kernel, as every rank runs it), the partial sums added in rank order —
    what ``RowParallelLinear`` + an all-reduce computes, without a second process."""

    def __init__(self, weight: torch.Tensor, kernel, tp: int = 2):
        super().__init__()
        from pagedllm.models.dense_linears import dense_weight

        self.k = weight.shape[1] // tp
        self.kernel = kernel
        self.states = [kernel.prepare(dense_weight(w.contiguous()), weight.dtype, weight.device)
                       for w in weight.split(self.k, dim=1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = [self.kernel.apply(st, xi.contiguous(), None) for st, xi in zip(self.states, x.split(self.k, dim=-1))]
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out


def row_split_engine(path: str, tp: int = 2) -> LLM:
    """The one-rank engine with every ``o_proj`` / ``down_proj`` (the row-parallel layers) computed as
    :class:`RowSplitLinear`: column-parallel layers and the vocab-parallel LM head stay whole."""
    llm = engine(path)
    model = llm.llm_engine.model
    kernel = llm.llm_engine.worker.backend.quantized_linear("unquantized", "float32")
    assert kernel is not None, "the backend has no float32 dense kernel"
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, f)))
    for i, layer in enumerate(model.layers):
        layer.self_attn.o_proj = RowSplitLinear(sd[f"model.layers.{i}.self_attn.o_proj.weight"].float(), kernel, tp)
        layer.mlp.down_proj = RowSplitLinear(sd[f"model.layers.{i}.mlp.down_proj.weight"].float(), kernel, tp)
    return llm


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def run_capturing_keyed_logits(llm: LLM, prompts: list[list[int]], max_tokens: int = 6):
    """Like :func:`run_capturing_logits`, but every float32 logits row is keyed by (request, position) instead of
    listed by step: a pipeline-parallel engine schedules its steps differently (batches in flight), yet each
    request's logits at each position must be the same."""
    worker = llm.llm_engine.worker
    inner, rows = worker.finish_model, {}

    def capture(pending, grammar=None):
        step = pending.result()  # (idempotent: finish_model asks again)
        for i, req in enumerate(step.requests):  # one sampled row per request (no speculation here)
            rows[(req.request_id, req.num_tokens)] = step.logits[i].clone()
        for req, first, plogits in step.prompt_logits:
            for j in range(plogits.shape[0]):
                rows[(req.request_id, "prompt", first + j)] = plogits[j].clone()
        return inner(pending, grammar)

    worker.finish_model = capture
    try:
        outs = _generate_workload(llm, prompts, max_tokens)
    finally:
        del worker.finish_model
    return [o.outputs[0].token_ids for o in outs], rows


def max_keyed_diff(got: dict, want: dict) -> tuple[float, float]:
    """(largest |difference|, largest |logit|) over the same (request, position) keys."""
    assert got.keys() == want.keys()
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    return worst, max(v.abs().max().item() for v in want.values())
