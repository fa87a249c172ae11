"""POST /score (vLLM's ``text_1`` / ``text_2``) and POST /rerank (Jina's and Cohere's ``query`` / ``documents``).

Two kinds of model score a pair, as in vLLM and the offline ``LLM.score``: a cross-encoder (a model serving the
``score`` task: one classification logit, or a reranker's yes/no) reads the pair as one prompt, tokenised as its HF
tokenizer pairs two texts; an embedding model (``embed`` only) embeds both texts and scores their cosine similarity.
Pairs are 1-to-1, 1-to-N (``text_1`` one text) or N-to-N pairwise; any other shape is a 400 naming ``text_2``.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch
from starlette.requests import Request

from pagedllm.entrypoints.openai.errors import APIError
from pagedllm.entrypoints.openai.extra_fields import check_extra_fields
from pagedllm.entrypoints.openai.protocol_pooling import RerankRequest, ScoreRequest
from pagedllm.entrypoints.openai.serving_common import random_id
from pagedllm.entrypoints.openai.serving_pooling import PoolingServing, supported_tasks
from pagedllm.outputs import ScoringOutput


def score_pairs(text_1: Any, text_2: Any, names: tuple[str, str] = ("text_1", "text_2")) -> list[tuple[str, str]]:
    """vLLM's pairing rule: one ``text_1`` against every ``text_2``, or equal-length lists pairwise."""
    t1 = [text_1] if isinstance(text_1, str) else list(text_1)
    t2 = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in zip(names, (t1, t2)):
        if not texts:
            raise APIError(400, f"{name}: must not be empty", param=name)
        if any(not t for t in texts):
            raise APIError(400, f"{name}: must not contain an empty string", param=name)
    if len(t1) == 1:
        t1 = t1 * len(t2)
    elif len(t1) != len(t2):
        raise APIError(400, f"{names[1]}: {names[0]} has {len(t1)} texts and {names[1]} {len(t2)}; give one "
                            f"{names[0]} (scored against every {names[1]}) or lists of the same length",
                       param=names[1])
    return list(zip(t1, t2))


class ScoreServing(PoolingServing):
    """Scores of text pairs; ``/score`` and ``/rerank`` differ only in their request and response shapes."""

    def check_score_task(self, route: str) -> str:
        """``score`` (a cross-encoder) or ``embed`` (cosine of embeddings): the way this model scores a pair."""
        tasks = supported_tasks(self.engine)
        if "score" in tasks:
            return "score"
        if "embed" in tasks:
            return "embed"
        raise self.task_error("score", route)

    async def scores(self, req: Any, pairs: list[tuple[str, str]], raw: Request, route: str, rid_prefix: str,
                     param: str) -> tuple[str, list[float], int]:
        """(request id, one score per pair, prompt tokens used)."""
        start = time.monotonic()
        lora = self.check_model(req.model)
        kind = self.check_score_task(route)
        check_extra_fields(req, route)
        texts = [t for p in pairs for t in p]
        self.check_text_size(texts, param)
        if kind == "score":
            params = self.pooling_params(task="score", use_activation=req.use_activation)
            ticket = self.admit(len(pairs), param)
            try:
                prompts = await self.pair_prompts(pairs, req.truncate_prompt_tokens, param, start)
                rid = random_id(rid_prefix)
                outs = await self.run(rid, prompts, params, raw, start, param, priority=req.priority, lora=lora)
            finally:
                ticket.release()
            scores = [ScoringOutput.from_base(o.outputs).score for o in outs]
            return rid, scores, sum(len(o.prompt_token_ids) for o in outs)
        # bi-encoder: embed each distinct text once, then cosine similarity of each pair
        unique = list(dict.fromkeys(texts))
        params = self.pooling_params(task="embed")
        ticket = self.admit(len(unique), param)
        try:
            prompts = await self.tokenize_items(unique, True, req.truncate_prompt_tokens, param, start)
            rid = random_id(rid_prefix)
            outs = await self.run(rid, prompts, params, raw, start, param, priority=req.priority, lora=lora)
        finally:
            ticket.release()
        emb = {t: o.outputs.data for t, o in zip(unique, outs)}
        scores = [float(torch.nn.functional.cosine_similarity(emb[a], emb[b], dim=0)) for a, b in pairs]
        return rid, scores, sum(len(o.prompt_token_ids) for o in outs)

    async def pair_prompts(self, pairs: list[tuple[str, str]], truncate: Optional[int], param: str,
                           start: float) -> list[dict]:
        """Each pair as one prompt, tokenised in a render worker as the HF tokenizer pairs two texts
        (``token_type_ids`` included when the tokenizer makes them)."""
        self.need_tokenizer()
        encoded = await self.render(("pairs", pairs), param, start)
        prompts = []
        for enc in encoded:
            p = {"prompt": None, "prompt_token_ids": enc["input_ids"]}
            if enc.get("token_type_ids") is not None:
                p["token_type_ids"] = enc["token_type_ids"]
            if truncate is not None and len(p["prompt_token_ids"]) > truncate:
                p = {k: (v[-truncate:] if isinstance(v, list) else v) for k, v in p.items()}
            self.check_pooling_length(len(p["prompt_token_ids"]), param)
            prompts.append(p)
        return prompts

    async def create_score(self, req: ScoreRequest, raw: Request) -> dict:
        pairs = score_pairs(req.text_1, req.text_2)
        rid, scores, n = await self.scores(req, pairs, raw, "/score", "score", "text_1")
        return {**self.head(rid, req),
                "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                "usage": {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}}

    async def create_rerank(self, req: RerankRequest, raw: Request, route: str = "/rerank") -> dict:
        if not req.query:
            raise APIError(400, "query: must not be empty", param="query")
        pairs = score_pairs(req.query, req.documents, ("query", "documents"))
        rid, scores, n = await self.scores(req, pairs, raw, route, "rerank", "documents")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        results = []
        for i in order:
            r: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if req.return_documents:
                r["document"] = {"text": req.documents[i]}
            results.append(r)
        return {"id": rid, "model": self.response_model(req), "results": results,
                "usage": {"prompt_tokens": n, "total_tokens": n}}
