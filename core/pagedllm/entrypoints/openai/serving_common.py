"""What completions and chat share: model check, request submission with OpenAI errors, SSE, deltas, logprobs.

Streaming deltas come from cumulative outputs: each choice remembers how much text and how many tokens it already
sent. While a request with stop strings is running, a text tail that could still grow into a stop string is held back
(as vLLM's detokenizer does), so a client never receives text that the final, truncated output lacks.

Every template render, tokenisation and detokenisation of a request goes to the render worker processes
(``render_pool.py``) with a time limit, never onto the event loop; only single-token texts for logprobs (cached) are
decoded here. A request holds admission slots (``limits.py``) from before its render until its response ends.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Iterator, Optional, Sequence

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream, RequestTimeoutError
from pagedllm.entrypoints.openai.errors import APIError, from_param_error
from pagedllm.entrypoints.openai.limits import Admission, ServerLimits, Ticket
from pagedllm.entrypoints.openai.metrics import ServerMetrics
from pagedllm.entrypoints.openai.render_pool import RenderPool, RenderTimeout
from pagedllm.entrypoints.openai.render_worker import RenderError
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.errors import ParamError
from pagedllm.generation_defaults import apply_defaults, get_diff_sampling_param, request_unset
from pagedllm.sampling_params import SamplingParams


# apply_chat_template's own parameters: a request's chat_template_kwargs may not override them (tokenize,
# chat_template, return_tensors, ...); everything else is handed to the template as vLLM does.
_APPLY_CHAT_TEMPLATE_ARGS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs"})


# A structured-output ParamError from the engine names ``structured_outputs.<kind>``; the request's own field is
# reported instead (``structured_rename``). Before that is known, the top-level name stands.
STRUCTURED_RENAME = {f"structured_outputs.{k}": "structured_outputs"
                     for k in ("json", "regex", "choice", "grammar", "json_object")}


def timeout_error(limit: Optional[float]) -> APIError:
    return APIError(408, f"the request ran past its deadline of {limit:g} s (--request-timeout) and was aborted",
                    code="request_timeout")


@contextmanager
def engine_failures(limits: ServerLimits) -> Iterator[None]:
    """The engine's failures while a whole response is awaited, as HTTP errors: a dead engine is 503, a request past
    its deadline (``--request-timeout``) 408. (Streams send the same as an SSE error event instead.)"""
    try:
        yield
    except EngineDeadError as e:
        raise APIError(503, str(e), code="engine_unavailable") from None
    except RequestTimeoutError:
        raise timeout_error(limits.request_timeout) from None


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"

#: Longest stretch the event loop is held while a whole response is assembled (``json_response``).
ASSEMBLY_SLICE_S = 0.002
#: The HTTP process's GIL switch interval (CPython's default: 5 ms). Render round trips and large-body checks run on
#: threads beside the loop; while the loop works through an assembly, such a thread waits up to this long each time it
#: wants the GIL back (several times per round trip): at 5 ms a one-word render next to an n=128, logprobs=20 response
#: took 30-540 ms, at 0.5 ms 12-31 ms (issue 34's probe, 2 cores).
GIL_SWITCH_INTERVAL_S = 0.0005
_encode = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode  # JSONResponse's


async def json_response(head: dict, choices: Iterable[Callable[[], dict]], usage: dict,
                        key: str = "choices") -> Response:
    """``{**head, key: [...], "usage": usage}`` as JSONResponse would encode it, each choice (or pooling ``data``
    item) built and encoded on its own with the event loop let go every few milliseconds.

    Why: ``n=128, logprobs=20, max_tokens=100`` is 270 000 logprob entries; built and encoded in one go, that held
    the loop (and ``/health``) for 420 ms (issue 34). One choice is at most a few ms of work."""
    parts: list[bytes] = []
    last = time.monotonic()
    for build in choices:
        parts.append(_encode(build()).encode("utf-8"))
        if time.monotonic() - last > ASSEMBLY_SLICE_S:
            await asyncio.sleep(0)
            last = time.monotonic()
    body = b"".join((_encode(head)[:-1].encode("utf-8"), f',"{key}":['.encode(), b",".join(parts), b'],"usage":',
                     _encode(usage).encode("utf-8"), b"}"))
    return Response(body, media_type="application/json")


def sse_choice_chunk(rid: str, obj_type: str, created: int, model: str, choice: dict, stop_reason,
                     token_ids: Optional[list[int]], usage: Optional[dict]) -> str:
    """One streamed choice (chat ``delta`` or completion ``text`` already in ``choice``) as an SSE event."""
    choice["stop_reason"] = stop_reason
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body = {"id": rid, "object": obj_type, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return sse(body)


def stable_text(text: str, params: SamplingParams, finished: bool) -> str:
    """``text`` minus a tail that is a proper prefix of a stop string (only while unfinished)."""
    if finished or not params.stop or params.include_stop_str_in_output:
        return text
    longest = max(len(s) for s in params.stop)
    for n in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-n:]
        if any(s.startswith(tail) for s in params.stop):
            return text[:-n]
    return text


@dataclass
class ChoiceState:
    """Per streamed choice: what was already sent."""

    text_len: int = 0
    num_tokens: int = 0
    started: bool = False
    finished: bool = False
    held: str = ""  # tool_choice=auto: the text so far, as its tool parser has seen it
    called: bool = False
    tool_parser: Any = None  # the --tool-call-parser instance of an "auto" choice

    def delta(self, c: CompletionOutput, params: SamplingParams) -> tuple[str, int, int]:
        """(new text, first new token index, end token index) since the last call."""
        text = stable_text(c.text, params, c.finish_reason is not None)
        new_text = text[self.text_len:] if len(text) > self.text_len else ""
        self.text_len = max(self.text_len, len(text))
        start, end = self.num_tokens, len(c.token_ids)
        self.num_tokens = end
        return new_text, start, end


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    per_prompt: dict = field(default_factory=dict)
    reasoning_tokens: Optional[int] = None  # chat with a reasoning parser: vLLM's completion_tokens_details

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                               "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.reasoning_tokens is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": self.reasoning_tokens}
        return out


class Serving:
    """Handler state shared by the endpoints: the engine, served names, metrics and a token-text cache."""

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str], metrics: ServerMetrics,
                 chat_template: Optional[str] = None, limits: Optional[ServerLimits] = None,
                 admission: Optional[Admission] = None, renderer: Optional[RenderPool] = None):
        self.engine = engine
        self.limits = limits or ServerLimits()
        self.admission = admission or Admission(self.limits.max_num_queued_reqs, self.limits.retry_after_s)
        self.renderer = renderer
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.vocab_size
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.metrics = metrics
        self.chat_template = chat_template
        self._token_text: dict[int, str] = {}
        #: The model's generation_config.json sampling defaults, for fields a request leaves unset (vLLM's)
        self.default_sampling_params = get_diff_sampling_param(engine.model_path, engine.config.generation_config)

    # ---- validation -------------------------------------------------------------------------------------------
    def check_model(self, model: Optional[str]) -> Optional[LoRARequest]:
        """None for the base model's names; the adapter a LoRA name selects; else 404 in OpenAI's shape."""
        loras = getattr(self.engine, "loras", {})
        lora = loras.get(model) if model is not None else None
        if lora is not None:
            return lora
        if model is not None and model not in self.served_model_names:
            served = self.served_model_names + list(loras)
            raise APIError(404, f"The model `{model}` does not exist. Served: {', '.join(served)}",
                           param="model", code="model_not_found")
        return None

    def response_model(self, req: Any) -> str:
        """The ``model`` a response reports: the adapter's name for a LoRA request (as vLLM does), else the first
        served name."""
        return req.model if req.model in getattr(self.engine, "loras", {}) else self.model_name

    def need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError(400, "this model was loaded without a tokenizer; send token ids", param="prompt")
        return self.tokenizer

    def check_lengths(self, prompt_len: int, max_tokens: Optional[int], field_name: str = "max_tokens",
                      prompt_field: str = "prompt") -> None:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise APIError(400, f"{prompt_field}: this model's maximum context length is {limit} tokens, but the "
                                f"prompt has {prompt_len} tokens (prompt plus at least one generated token must fit)",
                           param=prompt_field, code="context_length_exceeded")
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise APIError(400, f"{field_name}: this model's maximum context length is {limit} tokens; the prompt "
                                f"has {prompt_len} tokens, so {field_name} must be <= {limit - prompt_len}, got "
                                f"{max_tokens}", param=field_name, code="context_length_exceeded")

    def check_text_size(self, texts: Sequence[Optional[str]], param: str) -> None:
        """400 for text longer than any prompt that fits ``max_model_len`` could be (``max_rendered_chars``),
        before a render worker spends time (and memory) tokenising it."""
        limit = self.limits.max_rendered_chars(self.engine.max_model_len)
        size = sum(len(t) for t in texts if t)
        if size > limit:
            raise APIError(400, f"{param}: {size} characters of text, more than this server tokenises for a model "
                                f"of {self.engine.max_model_len} tokens ({limit})", param=param,
                           code="context_length_exceeded")

    # ---- deadlines, admission and rendering ------------------------------------------------------------------
    def remaining(self, start: float) -> Optional[float]:
        """Seconds left before the request's deadline (``start`` is its ``time.monotonic()`` arrival)."""
        if self.limits.request_timeout is None:
            return None
        left = self.limits.request_timeout - (time.monotonic() - start)
        if left <= 0:
            raise timeout_error(self.limits.request_timeout)
        return left

    def admit(self, slots: int, param: str = "n") -> Ticket:
        return self.admission.acquire(slots, param)

    async def render(self, job: tuple, param: str, start: float) -> Any:
        """Run a render-worker job within ``--template-render-timeout`` (and the request's deadline)."""
        if self.renderer is None:
            self.need_tokenizer()
            raise APIError(503, "the render workers are not running", code="renderer_unavailable")
        limit = self.limits.template_render_timeout
        left = self.remaining(start)
        budget = limit if left is None else min(limit, left)
        try:
            return await self.renderer.run(job, budget)
        except RenderTimeout:
            if left is not None and left <= limit:
                raise timeout_error(self.limits.request_timeout) from None
            raise APIError(400, f"{param}: rendering or tokenising this request took longer than {limit:g} s "
                                "(--template-render-timeout)", param=param, code="render_timeout") from None
        except RenderError as e:
            raise APIError(400, f"{param}: {e}", param=param) from None

    async def encode(self, texts: list[str], add_special_tokens: bool, param: str, start: float) -> list[list[int]]:
        self.need_tokenizer()
        return await self.render(("encode", texts, add_special_tokens), param, start)

    async def decode(self, id_lists: list[list[int]], param: str, start: float) -> list[str]:
        self.need_tokenizer()
        return await self.render(("decode", id_lists), param, start)

    async def render_chat(self, messages: list[dict], template: Optional[str], add_generation_prompt: bool,
                          continue_final_message: bool, kwargs: Optional[dict], start: float,
                          request_template: bool = False, tools: Optional[list] = None,
                          tools_prompt: Optional[str] = None) -> list[int]:
        """Token ids of ``messages`` under the chat template; problems are 400s naming ``messages`` (or
        ``chat_template`` / ``chat_template_kwargs`` when those are the request's own)."""
        if self.tokenizer is None:
            raise APIError(400, "messages: this model was loaded without a tokenizer", param="messages")
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "messages: the model's tokenizer has no chat template; start the server with "
                                "--chat-template or pass chat_template", param="messages")
        if kwargs:
            reserved = sorted(set(kwargs) & _APPLY_CHAT_TEMPLATE_ARGS)
            if reserved:
                raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set here",
                               param="chat_template_kwargs")
        job = ("chat", messages, template, add_generation_prompt, continue_final_message, kwargs,
               self.limits.max_rendered_chars(self.engine.max_model_len), tools, tools_prompt)
        return await self.render(job, "chat_template" if request_template else "messages", start)

    @staticmethod
    def structured_rename(req: Any) -> dict[str, str]:
        """Engine field names of a grammar error -> the request field that carried the grammar."""
        try:
            _, source = req.structured()
        except ParamError:
            return {}
        return {k: source for k in STRUCTURED_RENAME} if source else {}

    def request_params(self, req: Any, rename: Optional[dict[str, str]] = None) -> SamplingParams:
        """``req``'s SamplingParams, the model's generation defaults filling the fields it left unset."""
        return self.make_params(lambda: apply_defaults(req.to_sampling_params(), self.default_sampling_params,
                                                       request_unset(req)), rename)

    @staticmethod
    def make_params(build, rename: Optional[dict[str, str]] = None) -> SamplingParams:
        try:
            return build()
        except ParamError as e:
            raise from_param_error(e, rename) from None

    # ---- submission -------------------------------------------------------------------------------------------
    async def submit(self, request_id: str, prompt: dict, params: SamplingParams, arrival: float,
                     rename: Optional[dict[str, str]] = None, start: Optional[float] = None,
                     lora: Optional[LoRARequest] = None) -> RequestStream:
        with engine_failures(self.limits):
            try:
                return await self.engine.add_request(request_id, prompt, params, arrival_time=arrival,
                                                     priority=params.priority, lora_request=lora,
                                                     timeout=self.remaining(start) if start is not None else None)
            except ParamError as e:
                raise from_param_error(e, rename) from None

    async def submit_all(self, base_id: str, prompts: list[dict], params: SamplingParams, arrival: float,
                         rename: Optional[dict[str, str]] = None, start: Optional[float] = None,
                         lora: Optional[LoRARequest] = None) -> list[RequestStream]:
        """All-or-nothing: if one prompt is rejected, the ones already queued are aborted."""
        streams: list[RequestStream] = []
        try:
            for i, p in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.submit(rid, p, params, arrival, rename, start, lora))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    def finished(self, out: RequestOutput) -> None:
        self.metrics.observe_finished(out)

    # ---- token text and logprobs ------------------------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        t = self._token_text.get(token_id)
        if t is None:
            t = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"
            if len(self._token_text) < 1_000_000:
                self._token_text[token_id] = t
        return t

    def top_entries(self, lp: dict, k: int) -> list[tuple[int, float]]:
        """The top-``k`` (token id, logprob) pairs of one position, by rank."""
        items = sorted(lp.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None else 1 << 30,
                                                    -kv[1].logprob))
        return [(t, v.logprob) for t, v in items[:k]]

    def chat_logprobs(self, c: CompletionOutput, start: int, end: int, k: int) -> Optional[dict]:
        if c.logprobs is None:
            return None
        content = []
        for i in range(start, min(end, len(c.logprobs), len(c.token_ids))):
            tid, lp = c.token_ids[i], c.logprobs[i]
            tok = self.token_text(tid)
            entry = lp.get(tid)
            content.append({"token": tok, "logprob": entry.logprob if entry is not None else None,
                            "bytes": list(tok.encode("utf-8")),
                            "top_logprobs": [{"token": self.token_text(t), "logprob": v,
                                              "bytes": list(self.token_text(t).encode("utf-8"))}
                                             for t, v in self.top_entries(lp, k)]})
        return {"content": content}

    def completion_logprobs(self, c: CompletionOutput, start: int, end: int, k: int,
                            offset: int) -> Optional[dict]:
        if c.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        for i in range(start, min(end, len(c.logprobs), len(c.token_ids))):
            tid, lp = c.token_ids[i], c.logprobs[i]
            tok = self.token_text(tid)
            entry = lp.get(tid)
            tokens.append(tok)
            token_lps.append(entry.logprob if entry is not None else None)
            tops.append({self.token_text(t): v for t, v in self.top_entries(lp, k)} if k > 0 else None)
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as they come: yields (prompt index, cumulative output)."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


class _EngineStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine requests however it ends (done, client disconnect, server error).

    A disconnect cancels the response task, possibly while it awaits ``send`` with the body generator parked at a
    ``yield``; that generator would only be closed later by garbage collection, so the abort happens here instead.
    """

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream], metrics: ServerMetrics,
                 ticket: Optional[Ticket] = None):
        super().__init__(content, media_type="text/event-stream")
        self.streams = streams
        self.metrics = metrics
        self.ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                s.abort()
            if any(s.aborted for s in self.streams):
                self.metrics.aborted.inc()
            if self.ticket is not None:
                self.ticket.release()


def stream_response(content: AsyncIterator[str], streams: list[RequestStream],
                    metrics: ServerMetrics, ticket: Optional[Ticket] = None) -> StreamingResponse:
    return _EngineStreamingResponse(content, streams, metrics, ticket)


async def until_disconnect(coro: Awaitable, raw: Request, metrics: Optional[ServerMetrics] = None) -> Any:
    """Await ``coro`` but cancel it (its finally blocks abort the engine requests) if the client goes away."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while True:
            msg = await raw.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        if metrics is not None:
            metrics.aborted.inc()
        raise APIError(499, "client disconnected", code="client_closed_request")
    return task.result()


def now() -> int:
    return int(time.time())
