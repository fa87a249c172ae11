"""What the pooling endpoints share, and ``POST /pooling`` (the pooler's raw output).

A pooling request is one engine request per input, each a whole prompt that returns one ``PoolingRequestOutput``
(no sampling, no stream). Inputs are tokenised exactly as the offline ``LLM.embed`` does (``tokenizer.encode``, in a
render worker with a time limit) so their lengths are checked before queueing (400 naming the field and the limit)
and the server's vectors equal the offline ones. A request holds one admission slot per input until it ends; a client
that goes away aborts every engine request it started.

Routes are refused by model kind, as vLLM does: a generation model answers the pooling routes with 400 naming the
model and the flag that turns it into a pooling model (``--runner pooling`` / ``--convert embed``), and a pooling
model answers completions and chat likewise (``check_generation``).
"""

from __future__ import annotations

import asyncio
import base64
import time
from functools import partial
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from starlette.requests import Request
from starlette.responses import Response

from pagedllm.entrypoints.openai.errors import APIError, from_param_error
from pagedllm.entrypoints.openai.extra_fields import check_extra_fields
from pagedllm.entrypoints.openai.protocol_pooling import PoolingRequest
from pagedllm.entrypoints.openai.serving_common import (Serving, engine_failures, json_response, now, random_id,
                                                      until_disconnect)
from pagedllm.entrypoints.openai.serving_mm import content_texts, mm_inputs
from pagedllm.errors import ParamError
from pagedllm.lora.request import LoRARequest
from pagedllm.pooling_params import PoolingParams

#: Flag named when a route does not fit the model: what turns a generation model into one that serves the task.
CONVERT_FLAG = {"embed": "--convert embed", "classify": "--convert classify", "score": "--convert embed",
                "reward": "--convert reward", "encode": "--runner pooling"}


def supported_tasks(engine: Any) -> frozenset[str]:
    """The pooling tasks the engine's model serves (empty for a generation model)."""
    return frozenset(t for t in getattr(engine, "supported_tasks", ("generate",)) if t != "generate")


def is_pooling_model(engine: Any) -> bool:
    return bool(supported_tasks(engine))


def encode_vector(data: torch.Tensor, encoding_format: str) -> Any:
    """A pooled tensor as JSON: nested lists of floats, or base64 of its little-endian float32 bytes (what OpenAI's
    client decodes with ``np.frombuffer(..., dtype="float32")``)."""
    t = data.detach().to(device="cpu", dtype=torch.float32)
    if encoding_format == "base64":
        return base64.b64encode(t.contiguous().numpy().astype("<f4", copy=False).tobytes()).decode("ascii")
    return t.tolist()


def usage(outputs: Sequence[Any]) -> dict[str, int]:
    n = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": n, "total_tokens": n, "completion_tokens": 0}


class PoolingServing(Serving):
    """Input checks, tokenisation, submission and collection for every pooling route."""

    # ---- route availability ----------------------------------------------------------------------------------
    def check_task(self, task: str, route: str) -> None:
        """400 unless the model serves ``task``: names the model and the flag that would."""
        if task not in supported_tasks(self.engine):
            raise self.task_error(task, route)

    def task_error(self, task: str, route: str) -> APIError:
        tasks = supported_tasks(self.engine)
        flag = CONVERT_FLAG[task]
        implied = "" if flag == "--runner pooling" else " (which implies --runner pooling)"
        how = f"start the server with {flag}{implied}"
        if task == "score":
            how = ("score needs an embedding model (--convert embed: cosine similarity) or a one-label "
                   "classifier (a cross-encoder); " + how)
        kind = ("a generation model" if not tasks else
                f"a pooling model for {', '.join(sorted(tasks))}, not {task}")
        return APIError(400, f"{route}: the model `{self.model_name}` is {kind}; {how} to serve {route}",
                        param="model", code="model_not_supported")

    def check_generation(self, route: str) -> None:
        """400 for completions and chat on a pooling model without an LM head (one with it generates too:
        ``LLMEngine.get_supported_tasks``)."""
        if "generate" not in getattr(self.engine, "supported_tasks", ("generate",)):
            raise APIError(400, f"{route}: the model `{self.model_name}` is a pooling model with no LM head; it "
                                f"serves /v1/embeddings, /pooling, /classify, /score and /rerank as its tasks "
                                f"allow, not generation (serve a generative model for {route})", param="model",
                           code="model_not_supported")

    # ---- inputs ----------------------------------------------------------------------------------------------
    @staticmethod
    def input_items(value: Any, param: str = "input") -> list:
        """``input`` as a list of texts and id lists (a single text or id list becomes a batch of one)."""
        if value is None:
            raise APIError(400, f"{param}: required", param=param)
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            items = [value]
        else:
            items = list(value)
        if not items:
            raise APIError(400, f"{param}: must not be empty", param=param)
        for it in items:
            if not it:
                raise APIError(400, f"{param}: must not contain an empty {'string' if isinstance(it, str) else 'list'}",
                               param=param)
        return items

    async def tokenize_items(self, items: list, add_special_tokens: bool, truncate: Optional[int], param: str,
                             start: float) -> list[dict]:
        """Prompt dicts (``prompt``, ``prompt_token_ids``) of ``items``; ids are checked against the vocabulary,
        lengths against ``max_model_len`` (after ``truncate_prompt_tokens`` keeps the last tokens, as vLLM)."""
        out: list[dict] = []
        for it in items:
            if isinstance(it, str):
                out.append({"prompt": it, "prompt_token_ids": None})
            else:
                if truncate is None and len(it) > self.engine.max_model_len:  # counted before any work
                    self.check_pooling_length(len(it), param)
                if any(not 0 <= t < self.vocab_size for t in it):
                    raise APIError(400, f"{param}: every token id must be in [0, {self.vocab_size})", param=param)
                out.append({"prompt": None, "prompt_token_ids": list(it)})
        texts = [p for p in out if p["prompt_token_ids"] is None]
        if texts:
            self.check_text_size([p["prompt"] for p in texts], param)
            ids = await self.encode([p["prompt"] for p in texts], add_special_tokens, param, start)
            for p, i in zip(texts, ids):
                p["prompt_token_ids"] = i
        return [self.fit(p, truncate, param) for p in out]

    def fit(self, prompt: dict, truncate: Optional[int], param: str) -> dict:
        ids = prompt["prompt_token_ids"]
        if truncate is not None and len(ids) > truncate:
            prompt = {"prompt": None, "prompt_token_ids": list(ids[-truncate:])}
        self.check_pooling_length(len(prompt["prompt_token_ids"]), param)
        return prompt

    def check_pooling_length(self, n: int, param: str) -> None:
        limit = self.engine.max_model_len
        if n > limit:
            raise APIError(400, f"{param}: this model's maximum context length is {limit} tokens, but the input has "
                                f"{n} tokens; shorten it or set truncate_prompt_tokens", param=param,
                           code="context_length_exceeded")
        if n == 0:
            raise APIError(400, f"{param}: an input has no tokens", param=param)

    async def text_prompts(self, req: Any, start: float) -> list[dict]:
        """The prompts of a request with ``input`` or chat ``messages`` (exactly one of them)."""
        if (req.input is None) == (req.messages is None):
            raise APIError(400, "input: give exactly one of input or messages", param="input")
        if req.input is not None:
            add = True if req.add_special_tokens is None else req.add_special_tokens
            return await self.tokenize_items(self.input_items(req.input), add, req.truncate_prompt_tokens, "input",
                                             start)
        if req.chat_template is not None and not self.limits.trust_request_chat_template:
            raise APIError(400, "chat_template: a request's own chat template is refused unless the server runs "
                                "with --trust-request-chat-template", param="chat_template")
        messages = (await mm_inputs(self).parse([m.to_template_dict() for m in req.messages])).messages
        self.check_text_size(content_texts(messages), "messages")
        ids = await self.render_chat(messages, req.chat_template or self.chat_template, req.add_generation_prompt,
                                     req.continue_final_message, req.chat_template_kwargs, start,
                                     request_template=req.chat_template is not None)
        return [self.fit({"prompt": None, "prompt_token_ids": ids}, req.truncate_prompt_tokens, "messages")]

    @staticmethod
    def pooling_params(rename: Optional[dict[str, str]] = None, **kw: Any) -> PoolingParams:
        try:
            return PoolingParams(**kw)
        except ParamError as e:
            raise from_param_error(e, rename) from None

    # ---- submission ------------------------------------------------------------------------------------------
    async def run(self, base_id: str, prompts: list[dict], params: PoolingParams, raw: Request, start: float,
                  param: str = "input", rename: Optional[dict[str, str]] = None, priority: int = 0,
                  lora: Optional[LoRARequest] = None) -> list[Any]:
        """Every prompt's final ``PoolingRequestOutput``, in order; a client disconnect aborts them all (499). The
        engine's refusals of a prompt name ``param`` (the request's field)."""
        timeout = self.remaining(start)
        rename = {"prompt": param, "prompt_token_ids": param, **(rename or {})}

        async def one(i: int, p: dict) -> Any:
            rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
            final = None
            async for out in self.engine.encode(p, params, rid, lora_request=lora, priority=priority,
                                                timeout=timeout):
                final = out
            return final

        async def every() -> list[Any]:
            tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(prompts)]
            try:
                return await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:  # the first failure cancels the rest; their generators abort the engine requests
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        with engine_failures(self.limits):
            try:
                outs = await until_disconnect(every(), raw, self.metrics)
            except ParamError as e:
                raise from_param_error(e, rename) from None
        self.observe_pooled(len(outs), start)
        return outs

    def observe_pooled(self, n: int, start: float) -> None:
        """/metrics for finished pooling requests: end-to-end latency and successes (finished_reason "stop", as a
        prompt that ran to its end)."""
        self.metrics.e2e.observe(max(time.monotonic() - start, 0.0))
        self.metrics.success.labels(self.model_name, "stop").inc(n)

    async def pool(self, req: Any, raw: Request, task: str, route: str, rid_prefix: str,
                   rename: Optional[dict[str, str]] = None, **params: Any) -> tuple[str, list[Any]]:
        """The common route body: model and task checks, admission, prompts, submission; (request id, outputs)."""
        start = time.monotonic()
        lora = self.check_model(req.model)
        self.check_task(task, route)
        check_extra_fields(req, route)
        pooling_params = self.pooling_params(rename, task=task, **params)
        n = len(self.input_items(req.input)) if getattr(req, "input", None) is not None else 1
        ticket = self.admit(n, "input")
        try:
            prompts = await self.text_prompts(req, start)
            rid = random_id(rid_prefix)
            field = "input" if getattr(req, "input", None) is not None else "messages"
            return rid, await self.run(rid, prompts, pooling_params, raw, start, field, rename, req.priority, lora)
        finally:
            ticket.release()

    def head(self, rid: str, req: Any) -> dict:
        return {"id": rid, "object": "list", "created": now(), "model": self.response_model(req)}

    async def respond(self, rid: str, req: Any, items: Iterable[Callable[[], dict]], outs: Sequence[Any]) -> Response:
        """``{id, object: "list", created, model, data: [...], usage}``, each item built and encoded on its own with
        the event loop let go between them (2048 inputs of 4096 floats are 8M numbers to format)."""
        return await json_response(self.head(rid, req), items, usage(outs), key="data")


class PoolingEndpoint(PoolingServing):
    """``POST /pooling``: the pooler's output as it is (a vector, or one per token for ALL pooling)."""

    async def create(self, req: PoolingRequest, raw: Request) -> Response:
        tasks = supported_tasks(self.engine)
        task = req.task or ("encode" if "encode" in tasks else next(iter(sorted(tasks)), "encode"))
        rid, outs = await self.pool(req, raw, task, "/pooling", "pool", dimensions=req.dimensions,
                                    normalize=req.normalize)
        return await self.respond(rid, req, [partial(self.item, i, o, req.encoding_format)
                                             for i, o in enumerate(outs)], outs)

    @staticmethod
    def item(i: int, out: Any, encoding_format: str) -> dict:
        return {"index": i, "object": "pooling", "data": encode_vector(out.outputs.data, encoding_format)}
