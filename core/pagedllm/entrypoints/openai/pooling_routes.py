"""The pooling routes (``/v1/embeddings``, ``/pooling``, ``/classify``, ``/score``, ``/rerank``) on the app.

Registered on every server, as vLLM's are: on a generation model they answer 400 naming the model and the flag that
makes it a pooling model, so a client learns what to change instead of getting a 404.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from pagedllm.entrypoints.openai.protocol import ErrorResponse
from pagedllm.entrypoints.openai.protocol_pooling import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from pagedllm.entrypoints.openai.serving_classification import ClassificationServing
from pagedllm.entrypoints.openai.serving_embedding import EmbeddingServing
from pagedllm.entrypoints.openai.serving_pooling import PoolingEndpoint, PoolingServing
from pagedllm.entrypoints.openai.serving_score import ScoreServing

_ERRORS: dict[int, dict[str, Any]] = {c: {"model": ErrorResponse} for c in (400, 401, 404, 408, 413, 429, 499, 503)}


def add_pooling_routes(app: FastAPI, *serving_args: Any) -> PoolingServing:
    """Add the routes; ``serving_args`` are :class:`~pagedllm.entrypoints.openai.serving_common.Serving`'s. Returns
    one handler whose ``check_generation`` refuses completions and chat on a pooling model."""
    embeddings, pooling = EmbeddingServing(*serving_args), PoolingEndpoint(*serving_args)
    classify, score = ClassificationServing(*serving_args), ScoreServing(*serving_args)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def create_embedding(body: EmbeddingRequest, raw: Request) -> Response:
        return await embeddings.create(body, raw)

    @app.post("/pooling", response_model=PoolingResponse, responses=_ERRORS)
    async def create_pooling(body: PoolingRequest, raw: Request) -> Response:
        return await pooling.create(body, raw)

    @app.post("/classify", response_model=ClassificationResponse, responses=_ERRORS)
    async def create_classify(body: ClassificationRequest, raw: Request) -> Response:
        return await classify.create(body, raw)

    for path in ("/score", "/v1/score"):
        @app.post(path, response_model=ScoreResponse, responses=_ERRORS)
        async def create_score(body: ScoreRequest, raw: Request) -> dict:
            return await score.create_score(body, raw)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @app.post(path, response_model=RerankResponse, response_model_exclude_none=True, responses=_ERRORS)
        async def create_rerank(body: RerankRequest, raw: Request) -> dict:
            return await score.create_rerank(body, raw, raw.url.path)

    return embeddings
