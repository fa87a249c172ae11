"""POST /v1/chat/completions: messages -> the tokenizer's chat template -> choices, streamed as SSE or whole.

The template is applied as ``LLM.chat`` does (``apply_chat_template``: render, then encode without special tokens),
in a render worker process with a time limit, so greedy output matches the offline API and a hostile template cannot
stall the server. A request's own ``chat_template`` is refused (400 naming it) unless the operator passed
``--trust-request-chat-template``, as in vLLM.

A streamed choice opens with a ``{"role": "assistant"}`` delta and ends with a chunk carrying ``finish_reason``;
``stream_options.include_usage`` adds a final chunk with empty ``choices`` and the usage.

Tools (``tool_calling.py``): a named ``tool_choice`` streams its arguments as they are generated; ``auto`` streams
through the ``--tool-call-parser`` (``tool_parsers/``: content until a call may begin, then each call's name and
its arguments as they settle); ``required`` calls are parsed when the choice ends and sent as one delta each.

Reasoning (``--reasoning-parser``, ``pagedllm.reasoning``): each choice's text is split into ``reasoning`` (also sent
as ``reasoning_content``, vLLM's older name) and ``content``, whole or per delta with the same result; tool calls are
parsed from the content only, and a grammar (structured outputs, forced tool choices) constrains only the answer
(the engine's gate, ``structured_output/manager.py``). ``reasoning_effort`` reaches the template as a variable.
"""

from __future__ import annotations

import time
from functools import partial
from typing import AsyncIterator, Optional, Sequence

from starlette.requests import Request
from starlette.responses import Response

from pagedllm.engine.async_engine import EngineDeadError, RequestTimeoutError
from pagedllm.entrypoints.openai import tool_calling as tc
from pagedllm.entrypoints.openai.errors import APIError, error_body
from pagedllm.entrypoints.openai.extra_fields import check_extra_fields
from pagedllm.entrypoints.openai.grammar_gate import gate_grammar
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.serving_common import (SSE_DONE, STRUCTURED_RENAME, ChoiceState, Serving, Usage,
                                                      engine_failures, json_response, merge_streams, now, random_id,
                                                      sse, sse_choice_chunk, stream_response, timeout_error,
                                                      until_disconnect)
from pagedllm.entrypoints.openai.serving_mm import (MultiModalInputs, content_texts, mm_inputs,
    release_prompt)
from pagedllm.entrypoints.openai.errors import from_param_error
from pagedllm.errors import ParamError
from pagedllm.reasoning import ReasoningParser, ReasoningStream, get_reasoning_parser
from pagedllm.sampling_params import SamplingParams

_RENAME = {"logprobs": "top_logprobs", "prompt_token_ids": "messages", "prompt": "messages"}


class ChatServing(Serving):
    tool_parser: Optional[str] = None  # --tool-call-parser
    enable_auto_tool_choice = False  # --enable-auto-tool-choice
    reasoning_parser: Optional[str] = None  # --reasoning-parser
    mm: Optional[MultiModalInputs] = None  # content parts, images (serving_mm.py)

    def _reasoner(self, req: ChatCompletionRequest) -> Optional[ReasoningParser]:
        """A parser for this request (it may read the request's chat_template_kwargs, as Qwen3's does)."""
        if self.reasoning_parser is None:
            return None
        return get_reasoning_parser(self.reasoning_parser, self.need_tokenizer(),
                                    chat_template_kwargs=req.template_kwargs())

    def _tool_choice(self, req: ChatCompletionRequest) -> object:
        """The effective tool_choice; validates tools and sets the grammar of a forced choice."""
        try:
            choice = tc.check_request(req.tools, req.tool_choice, self.enable_auto_tool_choice, self.tool_parser,
                                      req.structured()[0] is not None)
        except ParamError as e:
            raise from_param_error(e) from None
        return choice

    async def create(self, req: ChatCompletionRequest, raw: Request):
        arrival, start = time.time(), time.monotonic()
        lora = self.check_model(req.model)
        check_extra_fields(req, "/v1/chat/completions")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
        choice = self._tool_choice(req)
        if choice == "auto":  # e.g. mistral keeps the special [TOOL_CALLS] token in the text
            req = tc.new_tool_parser(self.tool_parser, self.tokenizer).adjust_request(req)
        if req.chat_template is not None and not self.limits.trust_request_chat_template:
            raise APIError(400, "chat_template: a request-level chat template is not accepted by this server (the "
                                "operator can allow it with --trust-request-chat-template)", param="chat_template",
                           code="chat_template_not_allowed")
        reasoner = self._reasoner(req)
        if reasoner is not None:
            reasoner.adjust_request(req)  # before the params: GPT-OSS keeps its (special) channel markers
        params = self.request_params(req, {**_RENAME, **STRUCTURED_RENAME})
        forced = tc.forced_grammar(req.tools or [], choice, req.parallel_tool_calls)
        if forced is not None:
            params = params.clone(structured_outputs=forced)
        rename = {**_RENAME, **(self.structured_rename(req) if forced is None else
                                {k: "tools" for k in STRUCTURED_RENAME})}
        params = await gate_grammar(self, params, rename, raw, start)
        tools = tc.tools_for_template(req.tools) if req.tools and choice != "none" else None
        mm = mm_inputs(self)
        chat_inputs = await mm.parse([m.to_template_dict() for m in req.messages])
        messages = chat_inputs.messages
        self.check_text_size(content_texts(messages), "messages")
        ticket = self.admit(params.best_of)
        try:
            images = await mm.load(chat_inputs)
            ids = await self.render_chat(messages,
                                         req.chat_template or self.chat_template, req.add_generation_prompt,
                                         req.continue_final_message, req.template_kwargs(), start,
                                         request_template=req.chat_template is not None, tools=tools,
                                         tools_prompt=tc.tools_system_prompt(tools, self.tool_parser) if tools
                                         else None)
            prompt = await mm.prompt(self, ids, images, start)  # images: decoded and processed in a render worker
            try:
                field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
                self.check_lengths(len(prompt["prompt_token_ids"]), req.max_new_tokens, field,
                                   prompt_field="messages")
                rid = random_id("chatcmpl")
                streams = await self.submit_all(rid, [prompt], params, arrival, rename, start, lora)
            except BaseException:
                release_prompt(prompt)
                raise
            if req.stream:
                resp = stream_response(self._stream(rid, req, params, streams, choice, reasoner, ids), streams,
                                       self.metrics, ticket)
                ticket = None  # released when the response ends
                return resp
            return await until_disconnect(self._full(rid, req, params, streams, choice, reasoner, ids), raw,
                                          self.metrics)
        finally:
            if ticket is not None:
                ticket.release()

    def _tool_deltas(self, st: ChoiceState, full: str, text: str, choice: object, done: bool,
                     req: ChatCompletionRequest) -> list[dict]:
        """Stream deltas of one choice with tools: a named choice streams its arguments; ``auto`` streams through
        the tool parser; ``required`` calls are parsed and sent when the choice ends. ``text``: this delta's content
        (after the reasoning); ``full``: the choice's whole content once ``done``."""
        if not isinstance(choice, str):  # named: the whole output is the arguments
            out = []
            if not st.called:
                st.called = True
                out.append({"tool_calls": [{"index": 0, "id": tc.call_id(), "type": "function", "function": {
                    "name": choice.function.name, "arguments": ""}}]})
            if text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return out
        if choice == "auto":  # the parser's streaming method; its last delta completes what the final parse finds
            previous, st.held = st.held, st.held + text
            parser = st.tool_parser = st.tool_parser or tc.new_tool_parser(self.tool_parser, self.tokenizer)
            out = tc.delta_dicts(parser.extract_tool_calls_streaming(previous, st.held, text, (), (), (), req)
                                 if text else None)
            if done:
                out += tc.delta_dicts(parser.finish_streaming(st.held, req))
            st.called = st.called or any("tool_calls" in d for d in out)
            return out
        out = []
        if not done:
            return out
        calls = tc.forced_calls(full, choice)
        for i, call in enumerate(tc.openai_calls(calls)):
            st.called = True
            out.append({"tool_calls": [{"index": i, **call}]})
        return out

    def _k(self, req: ChatCompletionRequest) -> int:
        return req.top_logprobs or 0

    def _message(self, text: str, choice: object, req: ChatCompletionRequest,
                 rs: Optional[ReasoningStream] = None, include_reasoning: bool = True) -> tuple[dict, bool]:
        """The assistant message for ``text`` under ``choice`` (tool calls parsed from the content after the
        reasoning, when ``rs`` splits one off; the reasoning left out unless ``include_reasoning``); True when it
        carries tool calls."""
        reasoning = None
        if rs is not None:
            reasoning, text = rs.whole(text)
            text = text or ""
        calls: list = []
        content: Optional[str] = text
        if choice == "auto":
            info = tc.new_tool_parser(self.tool_parser, self.tokenizer).extract_tool_calls(text, req)
            content, calls = info.content, [t.model_dump() for t in info.tool_calls]
        elif choice != "none":
            calls, content = tc.openai_calls(tc.forced_calls(text, choice)), None
        msg: dict = {"role": "assistant", "content": content if content or rs is None else None}
        if rs is not None:
            msg["reasoning"] = msg["reasoning_content"] = reasoning if include_reasoning else None
        if calls:
            msg["tool_calls"] = calls
        return msg, bool(calls)

    @staticmethod
    def _finish(reason: Optional[str], has_calls: bool, choice: object) -> Optional[str]:
        return "tool_calls" if has_calls and reason == "stop" and choice in ("auto", "required") else reason

    async def _full(self, rid: str, req: ChatCompletionRequest, params: SamplingParams, streams,
                    choice: object = "none", reasoner: Optional[ReasoningParser] = None,
                    prompt_ids: Sequence[int] = ()) -> Response:
        final = None
        with engine_failures(self.limits):
            async for _, out in merge_streams(streams):
                if out.finished:
                    final = out
                    self.finished(out)
        usage = Usage(prompt_tokens=len(final.prompt_token_ids), reasoning_tokens=None if reasoner is None else 0)
        for c in final.outputs:
            usage.completion_tokens += len(c.token_ids)
            if reasoner is not None:
                usage.reasoning_tokens += _reasoning_tokens(ReasoningStream(reasoner, prompt_ids), c)

        def build(c) -> dict:
            msg, has_calls = self._message(c.text, choice, req,
                                           ReasoningStream(reasoner, prompt_ids) if reasoner is not None else None,
                                           req.include_reasoning)
            return {"index": c.index, "message": msg,
                    "logprobs": self.chat_logprobs(c, 0, len(c.token_ids), self._k(req)) if req.logprobs else None,
                    "finish_reason": self._finish(c.finish_reason, has_calls, choice), "stop_reason": c.stop_reason,
                    **({"token_ids": list(c.token_ids)} if req.return_token_ids else {})}

        kvt = final.kv_transfer_params  # a KV connector's P/D hand-off (vLLM's field)
        return await json_response({"id": rid, "object": "chat.completion", "created": now(),
                                    "model": self.response_model(req), **({"kv_transfer_params": kvt} if kvt else {})},
                                   [partial(build, c) for c in sorted(final.outputs, key=lambda c: c.index)],
                                   usage.as_dict())

    async def _stream(self, rid: str, req: ChatCompletionRequest, params: SamplingParams,
                      streams, choice: object = "none", reasoner: Optional[ReasoningParser] = None,
                      prompt_ids: Sequence[int] = ()) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(include_usage and req.stream_options.continuous_usage_stats)
        usage = Usage(reasoning_tokens=None if reasoner is None else 0)
        states: dict[int, ChoiceState] = {}
        splits: dict[int, ReasoningStream] = {}  # per choice, with a reasoning parser

        def chunk(index: int, delta: dict, logprobs: Optional[dict] = None, finish: Optional[str] = None,
                  stop_reason=None, token_ids: Optional[list[int]] = None) -> str:
            return sse_choice_chunk(rid, "chat.completion.chunk", created, self.response_model(req),
                                    {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish},
                                    stop_reason, token_ids, usage.as_dict() if continuous else None)

        try:
            for j in range(params.n):
                yield chunk(j, {"role": "assistant", "content": ""})
            async for _, out in merge_streams(streams):
                usage.prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    st = states.setdefault(c.index, ChoiceState())
                    if st.finished:
                        continue
                    text, start, end = st.delta(c, params)
                    usage.completion_tokens += end - start
                    lp = self.chat_logprobs(c, start, end, self._k(req)) if req.logprobs and end > start else None
                    finish = c.finish_reason
                    if finish is not None:
                        st.finished = True
                    ids = c.token_ids[start:end] if req.return_token_ids else None
                    full = c.text
                    if reasoner is not None:  # the reasoning goes out apart; the content goes on as before
                        rs = splits.get(c.index)
                        if rs is None:
                            rs = splits[c.index] = ReasoningStream(reasoner, prompt_ids)
                        thought, text = _reasoning_delta(rs, text, c.token_ids[start:end], finish is not None)
                        if thought and req.include_reasoning:
                            yield chunk(c.index, {"reasoning": thought, "reasoning_content": thought}, lp,
                                        token_ids=ids)
                            lp = ids = None
                        if finish is not None:
                            full = rs.whole(c.text)[1] or ""
                            usage.reasoning_tokens += _reasoning_tokens(rs, c)
                    if choice == "none":
                        if text or lp is not None or ids:
                            yield chunk(c.index, {"content": text}, lp, token_ids=ids)
                        if finish is not None:
                            yield chunk(c.index, {}, None, finish, c.stop_reason)
                        continue
                    has_calls = False
                    for delta in self._tool_deltas(st, full, text, choice, finish is not None, req):
                        has_calls = has_calls or "tool_calls" in delta
                        yield chunk(c.index, delta, lp, token_ids=ids)
                        lp = ids = None
                    if lp is not None or ids:
                        yield chunk(c.index, {}, lp, token_ids=ids)
                    if finish is not None:
                        yield chunk(c.index, {}, None, self._finish(finish, st.called or has_calls, choice),
                                    c.stop_reason)
                if out.finished:
                    self.finished(out)
            if include_usage:
                yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": self.response_model(req), "choices": [], "usage": usage.as_dict()})
        except EngineDeadError as e:
            yield sse(error_body(503, str(e), code="engine_unavailable"))
        except RequestTimeoutError:
            yield sse(error_body(408, timeout_error(self.limits.request_timeout).message, code="request_timeout"))
        yield SSE_DONE


def _reasoning_tokens(rs: ReasoningStream, c) -> int:
    """Output tokens of finished choice ``c`` that its parser counts as reasoning (vLLM's
    ``completion_tokens_details.reasoning_tokens``); 0 when its text holds no reasoning (the prompt ended it)."""
    return rs.parser.count_reasoning_tokens(c.token_ids) if rs.whole(c.text)[0] else 0


def _reasoning_delta(rs: ReasoningStream, text: str, token_ids: Sequence[int], done: bool) -> tuple[str, str]:
    """(reasoning, content) that this stream delta adds, plus what the split held back when the choice ends."""
    parts = [rs.delta(text, token_ids)]
    if done:
        parts.append(rs.finish())
    return ("".join(p.reasoning or "" for p in parts if p is not None),
            "".join(p.content or "" for p in parts if p is not None))
