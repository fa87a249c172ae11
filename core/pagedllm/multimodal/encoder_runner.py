"""The worker side of the encoder cache (vLLM's ``GPUModelRunner._execute_mm_encoder`` / ``_gather_mm_embeddings``):
run the vision encoder on the items the scheduler picked for this step, keep the outputs by content hash, and give
the step the embedding rows its chunks cover.

The step's embeddings reach the model as ``meta.extra["mm_embeds"] = (rows, embeds)``: flat token rows (int64
``[N]``) and their embeddings ``[N, hidden]``, which the model writes over its token embeddings. A chunk that
starts or ends inside an image takes just its slice of that image's output rows.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

import torch

from pagedllm.multimodal.encoder_cache import features_of
from pagedllm.multimodal.prefix_lm import step_prefix_ranges

logger = logging.getLogger(__name__)


class EncoderRunner:
    def __init__(self, model: Any, device: torch.device):
        self.model = model  # has ``embed_multimodal(list of processor tensor dicts) -> list of [tokens, hidden]``
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}  # mm hash -> encoder output (the embeddings of its placeholders)
        self.num_encoded = 0  # items run through the encoder (tests count re-encodes with it)
        self.warned_eager = False

    def free(self, mm_hashes: Iterable[str]) -> None:
        """Drop the outputs the scheduler's encoder cache evicted."""
        for h in mm_hashes:
            self.cache.pop(h, None)

    def execute(self, batch: list) -> None:
        """Encode, once per content hash and in one encoder call, the items whose placeholders this step's chunks
        cover and whose output is not cached: the ones the scheduler picked (``ScheduledRequest.encoder_inputs``),
        and any it believed cached but whose encoding never ran (a request preempted in the step that scheduled
        it)."""
        todo: dict[str, Any] = {}
        for s in batch:
            lo, hi = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for f in features_of(s.request):
                if f.mm_position.offset < hi and f.mm_position.end > lo and f.identifier not in self.cache:
                    todo.setdefault(f.identifier, f)
        if not todo:
            return
        outs = self.model.embed_multimodal([{k: v.to(self.device) if isinstance(v, torch.Tensor) else v
                                             for k, v in f.data.items()} for f in todo.values()])
        for (h, f), out in zip(todo.items(), outs):
            if out.shape[0] != f.num_encoder_tokens:
                raise RuntimeError(f"the encoder gave {out.shape[0]} rows for an item with {f.num_encoder_tokens} "
                                   "placeholder tokens")
            self.cache[h] = out
        self.num_encoded += len(todo)

    def gather(self, batch: list, query_start_loc_cpu: list[int]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """``(rows, embeds)`` of the step's placeholder tokens (None: the step has none)."""
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        for i, s in enumerate(batch):
            feats = features_of(s.request)
            if not feats:
                continue
            lo, hi = s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            for f in feats:
                start, end = max(lo, f.mm_position.offset), min(hi, f.mm_position.end)
                if start >= end:
                    continue
                out = self.cache.get(f.identifier)
                if out is None:
                    raise RuntimeError(f"request {s.request.request_id}: no encoder output for image {f.identifier} "
                                       "(the scheduler did not schedule its encoding)")
                off = f.mm_position.offset
                embeds.append(out[start - off:end - off])
                base = query_start_loc_cpu[i] - lo
                rows.append(torch.arange(base + start, base + end, dtype=torch.long))
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(embeds)

    def prepare(self, batch: list, meta: Any) -> bool:
        """Encode what this step needs and put its embedding rows in ``meta.extra`` for the model; True when the
        step has image rows."""
        self.execute(batch)
        mm = self.gather(batch, meta.query_start_loc_cpu)
        if mm is not None:
            meta.extra["mm_embeds"] = mm
            if getattr(self.model, "mm_prefix_lm", False):  # Gemma 3: each image's tokens attend to each other
                meta.mm_prefix_ranges = step_prefix_ranges(batch)
        return mm is not None

    def eager(self, runner: Any, step: Callable[[], Any]) -> Any:
        """Run ``step`` with the model called directly instead of the backend's graph runner: captured decode graphs
        and static-shape buckets replay programs over their own metadata, without ``meta.extra``'s image rows (a
        one-token chunk of an image would replay a decode graph). Text-only steps keep the graph runner."""
        if runner.run is runner.model and runner.sample is None:
            return step()
        if not self.warned_eager:
            self.warned_eager = True
            logger.info("steps that carry image embeddings run eagerly (the graph runner does not carry them)")
        run, sample = runner.run, runner.sample
        runner.run, runner.sample = runner.model, None
        try:
            return step()
        finally:
            runner.run, runner.sample = run, sample
