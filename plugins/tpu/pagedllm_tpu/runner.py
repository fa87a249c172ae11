"""The TPU model runner: one jitted XLA program per bucket shape runs forward, KV write, logits and sampling.

Returned from ``pagedllm_model_runner`` (core's escape hatch), it owns the whole step the way tpu-inference's
``TPUModelRunner`` does (vllm-project/tpu-inference ``tpu_inference/runner/tpu_runner.py``; precompilation of every
padded shape in ``runner/compilation_manager.py``):

- inputs are built and padded by core's ``ModelRunner.prepare`` under the backend's ``BucketPolicy`` (tokens padded
  to a power-of-two bucket from 16, sequences from 8 — tpu-inference's ``get_token_paddings`` / ``get_req_paddings``;
  one block-table width, ``max_model_len / page_size``, like tpu-inference's fixed ``pages_per_seq``), padding tokens
  written to the sink page;
- the step is ``jax.jit(step, donate_argnums=kv)``: the KV arrays are donated and returned, so the scatter updates
  them in place on the device; forward, logits of the sampled rows and on-device sampling are one program;
- every reachable bucket shape is compiled at start-up (``warmup``), so serving never compiles: the number of XLA
  compilations of the step is bounded by the bucket count (``stats["step_programs"]``);
- rows that need the host sampler (logprobs, penalties, seeds...) get float32 logits from the same program (fetched
  only then); prompt logprobs project the program's hidden states on the host with the torch model's head.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import numpy as np
import torch

from pagedllm.backend import (BatchShape, ModelRunner, RunnerContext, SamplerOutput, SamplingTensors,
                              ScheduledRequest, StepOutput, dummy_metadata, on_device_eligible, prompt_logit_spans)
from pagedllm_tpu import compiles, platform
from pagedllm_tpu import kv_cache as kvc
from pagedllm_tpu import mesh
from pagedllm_tpu import model as jmodel
from pagedllm_tpu.sampler import sample

logger = logging.getLogger(__name__)


def _step(spec: jmodel.ModelSpec, params: dict, kv: list, inputs: dict, key: Any, step: Any) -> tuple:
    """The whole step as one traced function: (sampled ids [S], logits [S, V] f32, hidden [T, H], new KV)."""
    import jax

    hidden, new_kv = jmodel.forward(spec, params, kv, inputs["input_ids"], inputs["positions"],
                                    inputs["slot_mapping"], inputs["cu_q_lens"], inputs["kv_lens"],
                                    inputs["page_indices"])
    logits = jmodel.compute_logits(spec, params, hidden[inputs["logits_indices"]])
    tokens = sample(logits, inputs["temperature"], inputs["top_k"], inputs["top_p"], inputs["min_p"],
                    jax.random.fold_in(key, step))
    return tokens, logits, hidden, new_kv


def step_inputs(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, logits_indices: list[int],
                tensors: SamplingTensors) -> dict[str, np.ndarray]:
    """The padded step as host arrays of fixed dtypes (a dtype change would be a new program)."""
    i32 = np.int32
    return {"input_ids": input_ids.numpy().astype(i32), "positions": positions.numpy().astype(i32),
            "slot_mapping": meta.slot_mapping.numpy().astype(i32),
            "cu_q_lens": meta.query_start_loc.numpy().astype(i32), "kv_lens": meta.seq_lens.numpy().astype(i32),
            "page_indices": meta.block_tables.numpy().astype(i32),
            "logits_indices": np.asarray(logits_indices, dtype=i32),
            "temperature": tensors.temperature.numpy().astype(np.float32), "top_k": tensors.top_k.numpy().astype(i32),
            "top_p": tensors.top_p.numpy().astype(np.float32), "min_p": tensors.min_p.numpy().astype(np.float32)}


class TPUModelRunner:
    """``execute(scheduled) -> StepOutput`` over JAX; ``stats`` reports buckets, compilations and warm-up time."""

    level = "full"

    def __init__(self, ctx: RunnerContext, model: Any, kv: Any):
        import jax

        compiles.install()
        self.cache_dir = platform.enable_compilation_cache()
        self.ctx, self.model = ctx, model
        self.caches = model.kv_caches  # JaxKVCache holders, shared with the worker (swap)
        self.device = platform.device()
        self.spec, self.params = jmodel.params_from_torch(model, ctx.dtype)
        # Core's input preparation and padding, without its forward (run=None: never called).
        self.prep = ModelRunner(model, None, kv, torch.device("cpu"), ctx.policy, ctx.pad_slot)
        rep, kv_sharding = mesh.replicated(), mesh.kv_sharding()
        self._inputs_sharding = rep
        # The KV outputs keep the inputs' sharding, so the next step (and swaps) present the same signature.
        self._step = jax.jit(partial(_step, self.spec), donate_argnums=(1,),
                             out_shardings=(rep, rep, rep, [kv_sharding] * len(self.caches)))
        self.key = jax.device_put(jax.random.PRNGKey(ctx.config.seed), rep)
        self.num_steps = 0
        self.shapes = list(ctx.policy.warmup_shapes())
        self.shapes_seen: set = set()
        self.stats: dict = {"buckets": len(self.shapes), "platform": self.device.platform,
                            "tensor_parallel": mesh.tp_size(), "compile_cache_dir": self.cache_dir}
        if ctx.config.enforce_eager:
            # XLA has no eager mode: as tpu-inference under enforce_eager (capture_model returns early), skip the
            # precompilation and compile each bucket on first use — still at most one program per bucket.
            self.stats.update(warmup_seconds=0.0, warmup_compiles=0, step_programs=0)
        else:
            self.warmup()

    # ---- running one program ---------------------------------------------------------------------------------
    def _run(self, inputs: dict[str, np.ndarray]) -> tuple:
        import jax

        dev = jax.device_put(inputs, self._inputs_sharding)
        kv = [c.array for c in self.caches]
        tokens, logits, hidden, new_kv = self._step(self.params, kv, dev, self.key, np.int32(self.num_steps))
        for c, a in zip(self.caches, new_kv):
            c.array = a
        self.num_steps += 1
        return tokens, logits, hidden

    def warmup(self) -> None:
        """Compile (or load from the persistent cache) the step for every bucket shape, writing only the sink page."""
        t0, before = time.perf_counter(), compiles.compiles()
        block = self.ctx.pad_slot // self.ctx.block_size if self.ctx.pad_slot >= 0 else 0
        for shape in self.shapes:
            meta = dummy_metadata(shape, self.ctx.block_size, torch.device("cpu"), self.ctx.pad_slot, block)
            ids = torch.zeros(shape.num_tokens, dtype=torch.long)
            out = self._run(step_inputs(ids, ids, meta, [0] * shape.num_seqs,
                                        SamplingTensors.build([], shape.num_seqs, torch.device("cpu"))))
            out[0].block_until_ready()
        if self.ctx.config.swap_space > 0:
            self._warm_swap_programs(block)
        self.stats.update(warmup_seconds=round(time.perf_counter() - t0, 3),
                          warmup_compiles=compiles.compiles() - before, step_programs=self.step_programs())
        logger.info("tpu: %d bucket shapes compiled in %.2fs (%d XLA compilations, platform %s, cache %s)",
                    len(self.shapes), self.stats["warmup_seconds"], self.stats["warmup_compiles"],
                    self.device.platform, self.cache_dir)

    def _warm_swap_programs(self, sink: int) -> None:
        """Swaps move power-of-two padded block lists (``kv_cache.pad_pow2``): compile the page gather (swap out) and
        scatter (swap in) for every power of two up to the pool size now, touching only the sink page."""
        n = self.caches[0].shape[0]
        m = 1
        while True:
            ids = np.full(m, sink, dtype=np.int32)
            np.asarray(kvc.block_program("gather")(self.caches[0].array, ids))
            pages = np.zeros((m,) + self.caches[0].shape[1:], dtype=self.caches[0].dtype)
            self.caches[0].array = kvc.block_program("scatter")(self.caches[0].array, ids, pages)
            if m >= n:
                break
            m *= 2

    def step_programs(self) -> int:
        """Distinct compiled versions of the step (one per bucket shape it has run)."""
        return int(self._step._cache_size())

    # ---- the step --------------------------------------------------------------------------------------------
    def execute(self, scheduled: list[ScheduledRequest]) -> StepOutput:
        batch = sorted(scheduled, key=lambda s: s.num_new_tokens != 1)  # decodes first (stable), as core's runner
        input_ids, positions, meta = self.prep.prepare(batch)
        shape = BatchShape(int(input_ids.shape[0]), int(meta.seq_lens.shape[0]), int(meta.block_tables.shape[1]))
        self.shapes_seen.add(shape)
        rows = [i for i, s in enumerate(batch) if s.samples]
        n = shape.num_seqs
        last = [meta.query_start_loc_cpu[i + 1] - 1 for i in rows]
        reqs = [batch[i].request for i in rows]
        tensors = SamplingTensors.build(reqs, n, torch.device("cpu"))
        tokens, logits, hidden = self._run(step_inputs(input_ids, positions, meta, last + [0] * (n - len(rows)),
                                                       tensors))
        out = StepOutput()
        want_prompt = any(s.request.prompt_logprobs is not None for s in batch)
        if rows:
            out.requests = reqs
            if all(on_device_eligible(batch[i]) for i in rows) and not want_prompt:
                ids = np.asarray(tokens)[: len(rows)].tolist()
                out.sampled = SamplerOutput(ids, [None] * len(ids), [0.0] * len(ids))
            else:
                out.logits = torch.from_numpy(np.array(np.asarray(logits)[: len(rows)]))
        if want_prompt:
            self._prompt_logits(batch, meta, hidden, out)
        return out

    def _prompt_logits(self, batch: list[ScheduledRequest], meta: Any, hidden: Any, out: StepOutput) -> None:
        """Prompt logprobs: the program's hidden states projected on the host by the torch model's head (a rare
        path; projecting on the device would need one more program per bucket)."""
        h = torch.from_numpy(np.asarray(hidden).astype(np.float32)).to(self.model.dtype)
        with torch.inference_mode():
            for r, lo, start, stop in prompt_logit_spans(batch, meta.query_start_loc_cpu):
                out.prompt_logits.append((r, lo, self.model.compute_logits(h[start:stop]).float()))
