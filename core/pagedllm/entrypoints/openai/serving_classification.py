"""POST /classify: each input's class probabilities (softmax; sigmoid for one label, as vLLM), the label of the
most likely class from the model's ``id2label``, and the number of classes. ``use_activation: false`` returns the
raw logits instead."""

from __future__ import annotations

import json
import os
from functools import partial
from typing import Any, Optional

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.entrypoints.openai.protocol_pooling import ClassificationRequest
from pagedllm.entrypoints.openai.serving_pooling import PoolingServing


def read_id2label(model_path: str) -> dict[int, str]:
    """``id2label`` of the checkpoint's ``config.json`` (empty when there is none)."""
    try:
        with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
            labels = json.load(f).get("id2label") or {}
        return {int(k): str(v) for k, v in labels.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


class ClassificationServing(PoolingServing):
    _id2label: Optional[dict[int, str]] = None

    @property
    def id2label(self) -> dict[int, str]:
        if self._id2label is None:
            self._id2label = read_id2label(self.engine.model_path) if os.path.isdir(self.engine.model_path) else {}
        return self._id2label

    async def create(self, req: ClassificationRequest, raw: Request) -> Response:
        rid, outs = await self.pool(req, raw, "classify", "/classify", "classify", use_activation=req.use_activation)
        return await self.respond(rid, req, [partial(self.item, i, o) for i, o in enumerate(outs)], outs)

    def item(self, i: int, out: Any) -> dict:
        probs = [float(x) for x in out.outputs.data.reshape(-1).tolist()]
        best = max(range(len(probs)), key=probs.__getitem__)
        return {"index": i, "label": self.id2label.get(best), "probs": probs, "num_classes": len(probs)}
