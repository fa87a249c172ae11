"""POST /v1/completions: prompt (text, token ids, or a batch of either) -> choices, streamed as SSE or whole.

Choice ``index`` is ``prompt_index * n + sample_index`` (OpenAI's and vLLM's convention for batched prompts).
Prompts are tokenized exactly as ``LLM.generate`` does (``tokenizer.encode``, in a render worker process with a time
limit) so that lengths are known before queueing (400 for an oversized prompt or ``max_tokens``, counted on token
ids) and greedy output matches the offline API token for token.
"""

from __future__ import annotations

import time
from functools import partial
from typing import AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.engine.async_engine import EngineDeadError, RequestTimeoutError
from pagedllm.entrypoints.openai.errors import APIError, error_body
from pagedllm.entrypoints.openai.extra_fields import check_extra_fields
from pagedllm.entrypoints.openai.grammar_gate import gate_grammar
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_common import (SSE_DONE, STRUCTURED_RENAME, ChoiceState, Serving, Usage,
                                                      engine_failures, json_response, merge_streams, now, random_id,
                                                      sse, sse_choice_chunk, stream_response, timeout_error,
                                                      until_disconnect)
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

_RENAME = {"prompt_token_ids": "prompt"}


class CompletionServing(Serving):
    async def create(self, req: CompletionRequest, raw: Request):
        arrival, start = time.time(), time.monotonic()
        lora = self.check_model(req.model)
        check_extra_fields(req, "/v1/completions")
        if req.suffix is not None:
            raise APIError(400, "suffix: not supported", param="suffix")
        params = self.request_params(req, STRUCTURED_RENAME)
        if req.echo and req.logprobs is not None:  # the echoed prompt carries its own logprobs (lm-eval scoring)
            params = params.clone(prompt_logprobs=req.logprobs)
        if req.stream and params.best_of > params.n:
            raise APIError(400, "best_of: must equal n when streaming", param="best_of")
        params = await gate_grammar(self, params, {**_RENAME, **self.structured_rename(req)}, raw, start)
        items = self._items(req.prompt)
        ticket = self.admit(len(items) * params.best_of)
        try:
            prompts = await self._prompts(items, start)
            for p in prompts:
                self.check_lengths(len(p["prompt_token_ids"]), req.max_tokens)
            if req.echo:
                todo = [p for p in prompts if p.get("prompt") is None]
                if todo:
                    texts = await self.decode([p["prompt_token_ids"] for p in todo], "prompt", start)
                    for p, t in zip(todo, texts):
                        p["prompt"] = t
            rid = random_id("cmpl")
            streams = await self.submit_all(rid, prompts, params, arrival, {**_RENAME, **self.structured_rename(req)},
                                            start, lora)
            if req.stream:
                resp = stream_response(self._stream(rid, req, params, prompts, streams), streams, self.metrics,
                                       ticket)
                ticket = None  # released when the response ends
                return resp
            return await until_disconnect(self._full(rid, req, params, prompts, streams), raw, self.metrics)
        finally:
            if ticket is not None:
                ticket.release()

    @staticmethod
    def _items(prompt) -> list:
        if isinstance(prompt, str):
            items = [prompt]
        elif prompt and isinstance(prompt[0], int):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        return items

    async def _prompts(self, items: list, start: float) -> list[dict]:
        out = []
        for p in items:
            if not p:
                raise APIError(400, "prompt: must not be empty", param="prompt")
            if isinstance(p, str):
                out.append({"prompt": p, "prompt_token_ids": None})
            else:
                if len(p) >= self.engine.max_model_len:  # counted on the ids, before any work
                    self.check_lengths(len(p), None)
                if any(not 0 <= t < self.vocab_size for t in p):
                    raise APIError(400, f"prompt: every token id must be in [0, {self.vocab_size})", param="prompt")
                out.append({"prompt": None, "prompt_token_ids": list(p)})
        texts = [p for p in out if p["prompt_token_ids"] is None]
        self.check_text_size([p["prompt"] for p in texts], "prompt")
        if texts:
            ids = await self.encode([p["prompt"] for p in texts], True, "prompt", start)
            for p, i in zip(texts, ids):
                p["prompt_token_ids"] = i
        return out

    def _choice(self, req: CompletionRequest, params: SamplingParams, i: int, c, prompt: dict) -> dict:
        text = c.text
        offset = 0
        if req.echo:
            text = prompt["prompt"] + text
            offset = len(prompt["prompt"])
        logprobs = None
        if req.logprobs is not None:
            logprobs = self.completion_logprobs(c, 0, len(c.token_ids), req.logprobs, offset)
            if req.echo:
                logprobs = self.prompt_completion_logprobs(prompt, req.logprobs, logprobs)
        ch = {"index": i * params.n + c.index, "text": text, "logprobs": logprobs,
              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if req.return_token_ids:
            ch["prompt_token_ids"] = prompt["prompt_token_ids"]
            ch["token_ids"] = list(c.token_ids)
        return ch

    async def _full(self, rid: str, req: CompletionRequest, params: SamplingParams, prompts: list[dict],
                    streams) -> Response:
        final: dict[int, RequestOutput] = {}
        with engine_failures(self.limits):
            async for i, out in merge_streams(streams):
                if out.finished:
                    final[i] = out
                    self.finished(out)
        usage = Usage()
        todo = []
        for i in range(len(prompts)):
            out = final[i]
            prompts[i]["prompt_logprobs"] = out.prompt_logprobs
            usage.prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                usage.completion_tokens += len(c.token_ids)
                todo.append((i * params.n + c.index, i, c))
        todo.sort(key=lambda t: t[0])
        kvt = final[0].kv_transfer_params if final else None  # a KV connector's P/D hand-off (vLLM's field)
        return await json_response({"id": rid, "object": "text_completion", "created": now(),
                                    "model": self.response_model(req), **({"kv_transfer_params": kvt} if kvt else {})},
                                   [partial(self._choice, req, params, i, c, prompts[i]) for _, i, c in todo],
                                   usage.as_dict())

    async def _stream(self, rid: str, req: CompletionRequest, params: SamplingParams, prompts: list[dict],
                      streams) -> AsyncIterator[str]:
        created = now()
        states: dict[tuple[int, int], ChoiceState] = {}
        usage = Usage()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)

        def chunk(index: int, text: str, logprobs: Optional[dict], finish: Optional[str], stop_reason,
                  token_ids: Optional[list[int]]) -> str:
            return sse_choice_chunk(rid, "text_completion", created, self.response_model(req),
                                    {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish},
                                    stop_reason, token_ids, usage.as_dict() if continuous else None)

        try:
            async for i, out in merge_streams(streams):
                if i not in usage.per_prompt:
                    usage.per_prompt[i] = len(out.prompt_token_ids)
                    usage.prompt_tokens += len(out.prompt_token_ids)
                for c in out.outputs:
                    st = states.setdefault((i, c.index), ChoiceState())
                    if st.finished:
                        continue
                    prefix = ""
                    if req.echo and not st.started:
                        prefix = prompts[i]["prompt"]
                    st.started = True
                    text, start, end = st.delta(c, params)
                    usage.completion_tokens += end - start
                    lp = None
                    if req.logprobs is not None and (end > start or prefix):
                        base = len(prompts[i]["prompt"]) if req.echo else 0  # offsets count the echoed prompt
                        lp = self.completion_logprobs(c, start, end, req.logprobs, base + st.text_len - len(text))
                        if prefix:  # the echoed prompt's own logprobs lead the first chunk
                            prompts[i]["prompt_logprobs"] = out.prompt_logprobs
                            lp = self.prompt_completion_logprobs(prompts[i], req.logprobs, lp)
                    finish = c.finish_reason
                    if finish is not None:
                        st.finished = True
                    ids = c.token_ids[start:end] if req.return_token_ids else None
                    if prefix or text or finish is not None or lp is not None or ids:
                        yield chunk(i * params.n + c.index, prefix + text, lp, finish,
                                    c.stop_reason if finish is not None else None, ids)
                if out.finished:
                    self.finished(out)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": self.response_model(req),
                           "choices": [], "usage": usage.as_dict()})
        except EngineDeadError as e:
            yield sse(error_body(503, str(e), code="engine_unavailable"))
        except RequestTimeoutError:
            yield sse(error_body(408, timeout_error(self.limits.request_timeout).message, code="request_timeout"))
        yield SSE_DONE

    def prompt_completion_logprobs(self, prompt: dict, k: int, generated: Optional[dict]) -> dict:
        """OpenAI's echo + logprobs: the prompt's tokens first (the first one has no logprob), then the generated."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for tid, lp in zip(prompt["prompt_token_ids"], prompt.get("prompt_logprobs") or []):
            tok = self.token_text(tid)
            entry = lp.get(tid) if lp is not None else None
            tokens.append(tok)
            token_lps.append(entry.logprob if entry is not None else None)
            tops.append({self.token_text(t): v for t, v in self.top_entries(lp, k)} if lp is not None and k > 0
                        else None)
            offsets.append(offset)
            offset += len(tok)
        gen = generated or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return {"tokens": tokens + gen["tokens"], "token_logprobs": token_lps + gen["token_logprobs"],
                "top_logprobs": tops + gen["top_logprobs"], "text_offset": offsets + gen["text_offset"]}
