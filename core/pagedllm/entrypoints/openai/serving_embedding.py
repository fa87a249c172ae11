"""POST /v1/embeddings: OpenAI's embeddings (text, ids, or a batch; float or base64; ``dimensions``) and vLLM's
chat-style form (``messages`` rendered with the chat template).

``dimensions`` is Matryoshka truncation done by the pooler (truncate, then renormalise, as vLLM): a model that does
not declare Matryoshka support, or a value outside what it supports, is a 400 naming ``dimensions`` (the engine's
``PoolingParams`` check). ``encoding_format="base64"`` is the little-endian float32 bytes OpenAI's client decodes.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.entrypoints.openai.protocol_pooling import EmbeddingRequest
from pagedllm.entrypoints.openai.serving_pooling import PoolingServing, encode_vector


class EmbeddingServing(PoolingServing):
    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        rid, outs = await self.pool(req, raw, "embed", "/v1/embeddings", "embd", dimensions=req.dimensions,
                                    normalize=req.normalize)
        return await self.respond(rid, req, [partial(self.item, i, o, req.encoding_format)
                                             for i, o in enumerate(outs)], outs)

    @staticmethod
    def item(i: int, out: Any, encoding_format: str) -> dict:
        return {"index": i, "object": "embedding", "embedding": encode_vector(out.outputs.data, encoding_format)}
