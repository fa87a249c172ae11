"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), built on the chat path.

The input items become chat messages (``protocol_responses.to_chat_messages``) and are rendered with the chat
template in a render worker exactly as /v1/chat/completions renders them, so a greedy response's ``output_text``
equals the same conversation's chat completion. ``instructions`` is a leading system message of this request only
(as OpenAI: it is not carried to a response that continues this one). ``previous_response_id`` continues a stored
response: its conversation, then its output items as the assistant's turn, then the new input.

Output items: a ``reasoning`` item when ``--reasoning-parser`` splits the text, then a ``message`` with one
``output_text`` part and/or ``function_call`` items (tools go through ``tool_calling.py``: a named or ``required``
choice is grammar-forced, ``auto`` needs the server's tool-call parser). A streamed response sends OpenAI's event
sequence (``response.created``, ``response.in_progress``, per item ``output_item.added`` ... ``output_item.done``,
then ``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it), each event with its
``sequence_number``; the final response is the same object a non-streamed request returns.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedllm.engine.async_engine import EngineDeadError, RequestTimeoutError
from pagedllm.entrypoints.openai import tool_calling as tc
from pagedllm.entrypoints.openai.errors import APIError, from_param_error
from pagedllm.entrypoints.openai.extra_fields import check_extra_fields
from pagedllm.entrypoints.openai.grammar_gate import gate_grammar
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.protocol_responses import (ResponsesRequest, parse_input, to_chat_messages,
                                                            unsupported_fields)
from pagedllm.entrypoints.openai.response_store import ResponseStore
from pagedllm.entrypoints.openai.serving_mm import (MultiModalInputs, content_texts, mm_inputs,
    release_prompt)
from pagedllm.entrypoints.openai.serving_common import (ChoiceState, Serving, engine_failures, merge_streams,
                                                      stream_response, timeout_error, until_disconnect)
from pagedllm.errors import ParamError
from pagedllm.generation_defaults import apply_defaults
from pagedllm.reasoning import ReasoningParserManager, ReasoningStream
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.limits import StructuredOutputsConfig


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str, param: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")


def message_item(text: str, mid: Optional[str] = None, status: str = "completed") -> dict:
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, rid: Optional[str] = None, status: str = "completed") -> dict:
    return {"id": rid or item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


def function_call_item(name: str, arguments: str, fid: Optional[str] = None, call_id: Optional[str] = None,
                       status: str = "completed") -> dict:
    return {"id": fid or item_id("fc"), "type": "function_call", "status": status,
            "call_id": call_id or f"call_{uuid.uuid4().hex[:24]}", "name": name, "arguments": arguments}


def _as_input(e: APIError) -> APIError:
    """A content-part error names ``input`` as this endpoint's other errors do (the part's path is in the message)."""
    e.param = "input"
    return e


class ResponsesServing(Serving):
    tool_parser: Optional[str] = None  # --tool-call-parser
    enable_auto_tool_choice = False  # --enable-auto-tool-choice
    store: ResponseStore
    mm: Optional[MultiModalInputs] = None  # content parts, images (serving_mm.py)

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        #: ``--reasoning-parser``; vLLM keeps it in the structured-outputs config (grammars start after it)
        config = StructuredOutputsConfig.parse(getattr(self.engine.config, "structured_outputs_config", None))
        self.reasoning_parser: Optional[str] = getattr(config, "reasoning_parser", None) or None

    # ---- request -> prompt ------------------------------------------------------------------------------------
    def _conversation(self, req: ResponsesRequest) -> list[dict]:
        """The chat messages this response continues and adds (without ``instructions``)."""
        try:
            new = to_chat_messages(parse_input(req.input))
        except ParamError as e:
            raise from_param_error(e) from None
        if req.previous_response_id is None:
            if not new:
                raise APIError(400, "input: must hold at least one item (or continue a previous_response_id)",
                               param="input")
            return new
        prev = self.store.get(req.previous_response_id)
        if prev is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        return prev.messages + to_chat_messages(parse_input(prev.response["output"])) + new

    def _params(self, req: ResponsesRequest, structured, skip_special_tokens: bool) -> SamplingParams:
        kw: dict[str, Any] = dict(max_tokens=req.max_output_tokens, seed=req.seed, priority=req.priority,
                                  structured_outputs=structured, skip_special_tokens=skip_special_tokens)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(req, name) is not None:
                kw[name] = getattr(req, name)
        unset = {"max_tokens": req.max_output_tokens}
        return self.make_params(lambda: apply_defaults(SamplingParams(**kw), self.default_sampling_params,
                                                       lambda f: unset.get(f, getattr(req, f, None)) is None),
                                {"max_tokens": "max_output_tokens"})

    async def create(self, req: ResponsesRequest, raw: Request):
        arrival, start = time.time(), time.monotonic()
        lora = self.check_model(req.model)
        try:
            unsupported_fields(req)
        except ParamError as e:
            raise APIError(400, str(e), param=e.field, code="unsupported_parameter") from None
        try:
            tools = req.function_tools()
            structured = req.structured()
            chat_tools = [t.to_chat_tool() for t in tools]
            choice = tc.check_request(chat_tools or None, req.chat_tool_choice(), self.enable_auto_tool_choice,
                                      self.tool_parser, structured is not None)
        except ParamError as e:
            raise from_param_error(e) from None
        check_extra_fields(req, "/v1/responses")
        conversation = self._conversation(req)
        mm = mm_inputs(self)
        try:  # images: checked (and below loaded) as chat's; the path goes in the message, param stays "input"
            chat_inputs = await mm.parse(([{"role": "system", "content": req.instructions}] if req.instructions
                                          else []) + conversation, "input")
        except APIError as e:
            raise _as_input(e) from None
        messages = chat_inputs.messages
        chat_req = self.chat_request(req, chat_tools, choice)
        forced = tc.forced_grammar(chat_tools, choice, req.parallel_tool_calls)
        params = self._params(req, forced if forced is not None else structured, chat_req.skip_special_tokens)
        rename = {f"structured_outputs.{k}": "tools" if forced is not None else "text.format"
                  for k in ("json", "regex", "choice", "grammar", "json_object")}
        params = await gate_grammar(self, params, rename, raw, start)
        template_tools = tc.tools_for_template(chat_tools) if chat_tools and choice != "none" else None
        kwargs = {"reasoning_effort": req.reasoning.effort} if req.reasoning and req.reasoning.effort else None
        self.check_text_size(content_texts(messages), "input")
        ticket = self.admit(1)
        try:
            try:
                images = await mm.load(chat_inputs)
            except APIError as e:
                raise _as_input(e) from None
            try:
                ids = await self.render_chat(messages, self.chat_template, True, False, kwargs, start,
                                             tools=template_tools,
                                             tools_prompt=tc.tools_system_prompt(template_tools, self.tool_parser)
                                             if template_tools else None)
            except APIError as e:
                if e.param == "messages":
                    e.param, e.message = "input", e.message.replace("messages:", "input:", 1)
                raise
            try:  # images: decoded and processed in a render worker
                prompt = await mm.prompt(self, ids, images, start, "input")
            except APIError as e:
                raise _as_input(e) from None
            try:
                self.check_lengths(len(prompt["prompt_token_ids"]), req.max_output_tokens, "max_output_tokens",
                                   prompt_field="input")
                rid = item_id("resp")
                streams = await self.submit_all(rid, [prompt], params, arrival, rename, start, lora)
            except BaseException:
                release_prompt(prompt)
                raise
            turn = _Turn(self, rid, req, chat_req, params, choice, conversation, ids)
            if req.stream:
                resp = stream_response(turn.events(streams), streams, self.metrics, ticket)
                ticket = None  # released when the response ends
                return resp
            return await until_disconnect(turn.whole(streams), raw, self.metrics)
        finally:
            if ticket is not None:
                ticket.release()

    def chat_request(self, req: ResponsesRequest, chat_tools: list, choice: Any) -> ChatCompletionRequest:
        """The request as the chat request it amounts to, for the tool and reasoning parsers (which read
        ``tools`` and may adjust it, e.g. keep special tokens); its messages are not used."""
        chat = ChatCompletionRequest(model=req.model, messages=[{"role": "user", "content": ""}],
                                     tools=chat_tools or None, tool_choice=choice,
                                     parallel_tool_calls=req.parallel_tool_calls,
                                     max_completion_tokens=req.max_output_tokens)
        if choice == "auto":
            chat = tc.new_tool_parser(self.tool_parser, self.tokenizer).adjust_request(chat)
        reasoner = self.new_reasoning_parser()
        return reasoner.adjust_request(chat) if reasoner is not None else chat

    # ---- stored responses -------------------------------------------------------------------------------------
    def retrieve(self, response_id: str) -> dict:
        entry = self.store.get(response_id)
        if entry is None:
            raise not_found(response_id, "response_id")
        return entry.response

    def delete(self, response_id: str) -> dict:
        if not self.store.delete(response_id):
            raise not_found(response_id, "response_id")
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def cancel(self, response_id: str) -> dict:
        """OpenAI cancels background responses only; this server runs none (``background`` is refused)."""
        self.retrieve(response_id)
        raise APIError(400, f"response_id: only background responses can be cancelled; '{response_id}' was not "
                            "created with background=true", param="response_id", code="invalid_request")

    # ---- parsers ----------------------------------------------------------------------------------------------
    def new_reasoning_parser(self) -> Any:
        name = self.reasoning_parser
        return ReasoningParserManager.get_reasoning_parser(name)(self.tokenizer) if name else None

    def new_tool_parser(self) -> Any:
        """The ``--tool-call-parser`` for ``tool_choice: auto`` (one per response: streaming keeps its state)."""
        return tc.new_tool_parser(self.tool_parser, self.tokenizer)


class _Turn:
    """One response being produced: builds its output items whole or as streamed events."""

    def __init__(self, serving: ResponsesServing, rid: str, req: ResponsesRequest, chat_req: ChatCompletionRequest,
                 params: SamplingParams, choice: Any, conversation: list[dict], prompt_ids: list[int]):
        self.s, self.rid, self.req, self.params, self.choice = serving, rid, req, params, choice
        self.chat_req = chat_req
        reasoner = serving.new_reasoning_parser()
        #: the reasoning split of this output, whole or streamed (None without --reasoning-parser)
        self.reasoning = ReasoningStream(reasoner, prompt_ids) if reasoner is not None else None
        self.conversation = conversation
        self.created = time.time()

    # ---- the response object ----------------------------------------------------------------------------------
    def response(self, status: str, output: list[dict], final: Optional[RequestOutput] = None,
                 reasoning_tokens: int = 0) -> dict:
        req = self.req
        usage = None
        incomplete = None
        if final is not None:
            c = final.outputs[0]
            n_in, n_out = len(final.prompt_token_ids), len(c.token_ids)
            usage = {"input_tokens": n_in, "input_tokens_details": {"cached_tokens": final.num_cached_tokens or 0},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                     "total_tokens": n_in + n_out}
            if status == "incomplete":
                incomplete = {"reason": "max_output_tokens"}
        choice = req.tool_choice
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
        return {
            "id": self.rid, "object": "response", "created_at": int(self.created), "status": status,
            "background": False, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "metadata": req.metadata or {},
            "model": self.s.response_model(req), "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": bool(req.store), "temperature": self.params.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": (choice.model_dump() if hasattr(choice, "model_dump") else choice) or
                           ("auto" if req.tools else "none"),
            "tools": [t.model_dump(exclude_none=True) for t in req.function_tools()],
            "top_p": self.params.top_p, "truncation": "disabled", "usage": usage, "user": req.user,
        }

    def finish(self, final: RequestOutput, output: list[dict], reasoning_tokens: int) -> dict:
        status = "incomplete" if final.outputs[0].finish_reason == "length" else "completed"
        resp = self.response(status, output, final, reasoning_tokens)
        if self.req.store:
            self.s.store.put(resp, self.conversation)
        self.s.finished(final)
        return resp

    def split_reasoning(self, c: CompletionOutput) -> tuple[Optional[str], str, int]:
        """(reasoning, content, reasoning tokens) of a finished output."""
        if self.reasoning is None:
            return None, c.text, 0
        reasoning, content = self.reasoning.whole(c.text)
        n = self.reasoning.parser.count_reasoning_tokens(c.token_ids) if reasoning is not None else 0
        return reasoning, content or "", n

    def content_items(self, content: str) -> list[dict]:
        """The message and function-call items of the (non-reasoning) text under the tool choice."""
        calls: list = []
        text: Optional[str] = content
        if self.choice == "auto":
            info = self.s.new_tool_parser().extract_tool_calls(content, self.chat_req)
            if info.tools_called:
                text, calls = info.content, [(c.function.name, c.function.arguments) for c in info.tool_calls]
        elif self.choice != "none":
            calls, text = tc.forced_calls(content, self.choice), None
        items = [message_item(text or "")] if text or not calls else []
        return items + [function_call_item(n, a) for n, a in calls]

    # ---- whole --------------------------------------------------------------------------------------------------
    async def whole(self, streams) -> Response:
        final = None
        with engine_failures(self.s.limits):
            async for _, out in merge_streams(streams):
                if out.finished:
                    final = out
        reasoning, content, n = self.split_reasoning(final.outputs[0])
        output = ([reasoning_item(reasoning)] if reasoning is not None else []) + self.content_items(content)
        return JSONResponse(self.finish(final, output, n))

    # ---- streamed -----------------------------------------------------------------------------------------------
    async def events(self, streams) -> AsyncIterator[str]:
        ev = ResponseEventStream()
        head = self.response("in_progress", [])
        yield ev.event("response.created", response=head)
        yield ev.event("response.in_progress", response=head)
        tools = self.s.new_tool_parser() if self.choice == "auto" else None
        named = None if isinstance(self.choice, str) else self.choice.function.name
        st = ChoiceState()
        content_text, content_ids = "", []  # the answer after the reasoning, as the tool parser has seen it
        final = None
        try:
            async for _, out in merge_streams(streams):
                c = out.outputs[0]
                delta, start, end = st.delta(c, self.params)
                new_ids = list(c.token_ids[start:end])
                steps = [(None, delta)]
                if self.reasoning is not None:
                    steps = [self.reasoning.delta(delta, new_ids)] + ([self.reasoning.finish()] if out.finished
                                                                      else [])
                    steps = [(m.reasoning, m.content) for m in steps if m is not None]
                content = ""
                for reasoning, part in steps:
                    if reasoning:
                        for e in ev.text("reasoning", reasoning):
                            yield e
                    content += part or ""
                if tools is not None and (content or out.finished):
                    step = tools.extract_tool_calls_streaming(content_text, content_text + content, content,
                                                              content_ids, content_ids + new_ids, new_ids,
                                                              self.chat_req)
                    content_text, content_ids = content_text + content, content_ids + new_ids
                    if out.finished:
                        step = _merge(step, tools.finish_streaming(content_text, self.chat_req))
                    for e in ev.parser_delta(step):
                        yield e
                elif self.choice == "none" and content:
                    for e in ev.text("message", content):
                        yield e
                elif named is not None and content:  # a named choice: the whole content is the arguments
                    for e in ev.call(0, named, content):
                        yield e
                else:  # required: the JSON array of calls is read when it is complete
                    content_text += content
                if out.finished:
                    final = out
        except EngineDeadError as e:
            yield ev.event("error", code="engine_unavailable", message=str(e), param=None)
            return
        except RequestTimeoutError:
            yield ev.event("error", code="request_timeout", param=None,
                           message=timeout_error(self.s.limits.request_timeout).message)
            return
        if self.choice == "required":
            for i, (name, args) in enumerate(tc.forced_calls(content_text, self.choice)):
                for e in ev.call(i, name, args):
                    yield e
        if not any(it["type"] in ("message", "function_call") for it in ev.output):
            for e in ev.text("message", ""):  # an empty answer is still a message
                yield e
        for e in ev.close_all():
            yield e
        reasoning_tokens = 0
        if self.reasoning is not None and any(it["type"] == "reasoning" for it in ev.output):
            reasoning_tokens = self.reasoning.parser.count_reasoning_tokens(final.outputs[0].token_ids)
        resp = self.finish(final, ev.output, reasoning_tokens)
        yield ev.event("response.completed" if resp["status"] == "completed" else "response.incomplete",
                       response=resp)


def _merge(a: Any, b: Any) -> Any:
    """Two streamed parser steps as one (content appended, tool-call pieces in order)."""
    if a is None or b is None:
        return a if b is None else b
    return a.model_copy(update={"content": (a.content or "") + (b.content or "") or None,
                                "tool_calls": list(a.tool_calls) + list(b.tool_calls)})


class ResponseEventStream:
    """The output items of a streamed response and the SSE events that build them, numbered in order.

    At most one text item (message or reasoning) is open at a time; function calls stay open until the end, since a
    tool parser may still add to an earlier call's arguments after a later call began."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []
        self.open: Optional[dict] = None  # the text item deltas go to
        self.calls: dict[int, dict] = {}  # open function_call items by the parser's call index

    def event(self, kind: str, **body: Any) -> str:
        data = json.dumps({"type": kind, **body, "sequence_number": self.seq}, ensure_ascii=False,
                          separators=(",", ":"))
        self.seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    def _index(self, item: dict) -> int:
        return next(i for i, it in enumerate(self.output) if it is item)

    def _done(self, item: dict) -> list[str]:
        item["status"] = "completed"
        i, out = self._index(item), []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                  text=part["text"], logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=i,
                                  content_index=0, part=part))
        elif item["type"] == "reasoning":
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=i,
                                  content_index=0, text=item["content"][0]["text"]))
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                  name=item["name"], arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=i, item=item))
        return out

    def close(self) -> list[str]:
        """Close the open text item."""
        item, self.open = self.open, None
        return self._done(item) if item is not None else []

    def close_all(self) -> list[str]:
        out = self.close()
        for item in self.calls.values():
            out += self._done(item)
        self.calls.clear()
        return out

    def _add(self, item: dict) -> list[str]:
        self.output.append(item)
        i = len(self.output) - 1
        added = {**item, "status": "in_progress"}
        if item["type"] == "reasoning":
            added["content"] = []
        out = [self.event("response.output_item.added", output_index=i, item=added)]
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=i,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": [],
                                                         "logprobs": []}))
        return out

    def text(self, kind: str, delta: str) -> list[str]:
        """``delta`` appended to the open ``kind`` ("message" or "reasoning") item, opened first if needed."""
        out: list[str] = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            self.open = message_item("", status="in_progress") if kind == "message" else \
                reasoning_item("", status="in_progress")
            out += self._add(self.open)
        if delta:
            item = self.open
            item["content"][0]["text"] += delta
            name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
            extra = {"logprobs": []} if kind == "message" else {}
            out.append(self.event(name, item_id=item["id"], output_index=self._index(item), content_index=0,
                                  delta=delta, **extra))
        return out

    def call(self, index: int, name: Optional[str], arguments: str) -> list[str]:
        """``arguments`` appended to function call ``index`` (added first, with ``name``, if new)."""
        out: list[str] = []
        item = self.calls.get(index)
        if item is None:
            out += self.close()
            item = self.calls[index] = function_call_item(name or "", "", status="in_progress")
            out += self._add(item)
        if arguments:
            item["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self._index(item), delta=arguments))
        return out

    def parser_delta(self, step: Any) -> list[str]:
        """A tool parser's streamed step (vLLM's ``DeltaMessage``): its content, then its call pieces."""
        if step is None:
            return []
        out = self.text("message", step.content) if step.content else []
        for d in step.tool_calls:
            fn = d.function
            out += self.call(d.index, fn.name if fn else None, (fn.arguments or "") if fn else "")
        return out
