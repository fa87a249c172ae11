"""Static shapes: a backend with a bucketed batch policy must only ever show its model shapes from the declared
bucket set (the warm-up set), and its outputs must equal the dynamic path: the same backend's kernels with the
identity policy, run eagerly. Shapes are recorded where core hands each step to the backend's graph runner, so a
compiled or replayed capture is seen too."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from pagedllm.backend.registry import Backend
from pagedllm.conformance.checks_e2e import MAX_TOKENS, e2e_max_len, e2e_prompts, selected_by_name, tiny_llama
from pagedllm.conformance.engine_context import runner_context
from pagedllm.conformance.harness import CaseContext, CheckFailed, Untested
from pagedllm.backend.hookspec import hookimpl
from pagedllm.worker.model_runner import ModelRunner

#: Hooks the dynamic twin does not take from the backend: its shape discipline and its runners.
STATIC_HOOKS = ("pagedllm_batch_policy", "pagedllm_graph_runner", "pagedllm_model_runner", "pagedllm_backend_info")


def is_static(backend: Backend, block_size: int) -> bool:
    """Whether the backend's batch policy (asked as the Worker asks it) is bucketed."""
    ctx = runner_context(backend, num_heads=4, num_kv_heads=2, head_size=16, vocab=128, block_size=block_size,
                         max_model_len=4 * block_size, max_num_seqs=4, max_num_batched_tokens=8 * block_size,
                         dtype=torch.float32, device=backend.device())
    return bool(ctx.policy.static)


def dynamic_twin(backend: Backend) -> Backend:
    """The backend's own kernels, allocator and memory hooks with core's identity policy and no runners."""
    hooks = {n: getattr(backend.plugin, n) for n in dir(backend.plugin)
             if n.startswith("pagedllm_") and n not in STATIC_HOOKS}
    info = backend.info

    @hookimpl
    def pagedllm_backend_info():
        return replace(info, name=f"{info.name}+dynamic", priority=-100)

    return Backend(SimpleNamespace(**hooks, pagedllm_backend_info=pagedllm_backend_info), f"{info.name}+dynamic")


def _shape(input_ids, meta) -> tuple[int, int, int]:
    return int(input_ids.shape[0]), int(meta.seq_lens.shape[0]), int(meta.block_tables.shape[1])


def _record_shapes(worker, model, seen: list) -> None:
    """Record (tokens, seqs, block-table width) of every forward. Core's model runner hands each step to the
    backend's graph runner (``run`` / ``sample``): wrapping those records the shapes whatever the runner captured
    (a compiled or replayed program never calls Python hooks on the model). A backend that owns the whole step
    (``pagedllm_model_runner``) is recorded at the model's forward instead."""
    runner = worker.runner
    if isinstance(runner, ModelRunner):
        for name in ("run", "sample"):
            fn = getattr(runner, name)
            if fn is not None:
                def recorded(input_ids, positions, meta, *rest, _fn=fn):
                    seen.append(_shape(input_ids, meta))
                    return _fn(input_ids, positions, meta, *rest)
                setattr(runner, name, recorded)
        return
    model.register_forward_pre_hook(lambda mod, args: seen.append(_shape(args[0], args[2])))


def _generate(backend: Backend, path: str, prompts: list, bs: int, record: bool, eager: bool):
    from pagedllm import LLM, SamplingParams  # heavy: the engine stack, not at CLI start

    with selected_by_name(backend):
        llm = LLM(model=path, device=backend.name, dtype="float32", block_size=bs, skip_tokenizer_init=True,
                  max_model_len=e2e_max_len(bs), max_num_seqs=4, max_num_batched_tokens=2 * bs + 8,
                  enforce_eager=eager)
    seen: list = []
    if record:
        _record_shapes(llm.llm_engine.worker, llm.llm_engine.model, seen)
    # Rows without logprobs sample inside the backend's region where it samples on the device; rows with logprobs
    # take the forward-only program and the host sampler: both paths are compared.
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2 if i % 2 else None, ignore_eos=True)
              for i in range(len(prompts))]
    with selected_by_name(backend):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, seen, [(list(o.outputs[0].token_ids), o.outputs[0].logprobs or []) for o in outs]


def check_static_shapes(ctx: CaseContext) -> None:
    bs = ctx.params["block_size"]
    path = tiny_llama(ctx.params["head_size"], max_positions=e2e_max_len(bs))
    prompts = e2e_prompts(ctx, bs)
    prompts.append(prompts[2][: 2 * bs - 1])  # four sequences, a token budget below the longest: chunked prefill
    llm, seen, static_out = _generate(ctx.backend, path, prompts, bs, record=True, eager=False)
    worker = llm.llm_engine.worker
    declared = set(worker.policy.warmup_shapes())
    if not seen:
        if isinstance(worker.runner, ModelRunner):  # recorded at run/sample: a step that reached neither is a bug
            raise CheckFailed("core's model runner handed no step to the backend's graph runner (run / sample)")
        raise Untested("no forward was recorded: the backend's own model runner (pagedllm_model_runner) never "
                       "called the model's forward, so shapes cannot be recorded")
    outside = sorted(set(seen) - declared)
    if outside:
        raise CheckFailed(f"the model saw {len(outside)} shape(s) (tokens, seqs, block-table width) outside the "
                          f"{len(declared)} declared bucket shapes, first {outside[:3]}")
    _, _, dynamic_out = _generate(dynamic_twin(ctx.backend), path, prompts, bs, record=False, eager=True)
    for i, ((got, got_lp), (want, want_lp)) in enumerate(zip(static_out, dynamic_out)):
        if got != want:
            k = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
            pos = len(prompts[i]) + k
            raise CheckFailed(f"sequence {i}: static path generated {got}, dynamic path {want}; first bad at "
                              f"position {pos}, block {pos // bs} offset {pos % bs}")
        for k, (a, b) in enumerate(zip(got_lp, want_lp)):
            if sorted(a) != sorted(b) or any(abs(a[t].logprob - b[t].logprob) > 1e-4 for t in a):
                pos = len(prompts[i]) + k
                raise CheckFailed(f"sequence {i}, position {pos} (block {pos // bs}): static logprobs "
                                  f"{ {t: round(v.logprob, 6) for t, v in a.items()} } != dynamic "
                                  f"{ {t: round(v.logprob, 6) for t, v in b.items()} }")
    ctx.notes.append(f"{len(set(seen))} distinct shapes seen of {len(declared)} declared; "
                     f"{len(seen)} forwards; block size {bs}")
