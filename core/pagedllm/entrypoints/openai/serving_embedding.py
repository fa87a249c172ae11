"""POST /v1/embeddings: OpenAI's embeddings (text, ids, or a batch; float or base64; ``dimensions``) and vLLM's
chat-style form (``messages`` rendered with the chat template).

``dimensions`` is Matryoshka truncation done by the pooler (truncate, then renormalise, as vLLM): a model that does
not declare Matryoshka support, or a value outside what it supports, is a 400 naming ``dimensions`` (the engine's
``PoolingParams`` check). ``encoding_format="base64"`` is the little-endian float32 bytes OpenAI's client decodes.
"""

from __future__ import annotations

from starlette.requests import Request

from pagedllm.entrypoints.openai.protocol_pooling import EmbeddingRequest
from pagedllm.entrypoints.openai.serving_pooling import PoolingServing, encode_vector, usage


class EmbeddingServing(PoolingServing):
    async def create(self, req: EmbeddingRequest, raw: Request) -> dict:
        rid, outs = await self.pool(req, raw, "embed", "/v1/embeddings", "embd", dimensions=req.dimensions,
                                    normalize=req.normalize)
        return {**self.head(rid),
                "data": [{"index": i, "object": "embedding",
                          "embedding": encode_vector(o.outputs.data, req.encoding_format)}
                         for i, o in enumerate(outs)],
                "usage": usage(outs)}
