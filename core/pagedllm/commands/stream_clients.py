"""Text streams for the terminal commands: an in-process engine or a running server (official ``openai`` client).

Both yield text pieces as they are produced, so ``generate --stream``, ``chat`` and ``complete`` print tokens as
they arrive. Leaving a stream early (Ctrl-C, a closed pipe) aborts the request: no KV blocks stay held.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

from pagedllm.errors import ParamError
from pagedllm.sampling_params import SamplingParams

Messages = list[dict[str, str]]


class LocalStreams:
    """Streams from an in-process :class:`~pagedllm.entrypoints.llm.LLM`, one request at a time."""

    _ids = itertools.count()

    def __init__(self, llm: Any, params: SamplingParams):
        self.llm = llm
        self.params = params.clone(output_kind="delta")
        self.model_name = llm.llm_engine.config.model or "default model"

    def _stream(self, prompt: Any) -> Iterator[str]:
        engine = self.llm.llm_engine
        rid = f"cli-{next(self._ids)}"
        engine.add_request(rid, prompt, self.params)
        finished = False
        try:
            while not finished:
                for out in engine.step():
                    if out.request_id != rid:
                        continue
                    finished = out.finished
                    if out.outputs and out.outputs[0].text:
                        yield out.outputs[0].text
                if not finished and not engine.has_unfinished_requests():
                    raise RuntimeError(f"request {rid} vanished without finishing")
        finally:
            if not finished:
                engine.abort_request(rid)

    def complete(self, prompt: str) -> Iterator[str]:
        return self._stream(prompt)

    def chat(self, messages: Messages) -> Iterator[str]:
        tok = self.llm.get_tokenizer()
        if tok is None or not getattr(tok, "chat_template", None):
            raise ParamError("model", "this model has no chat template; use `pagedllm complete` instead")
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        return self._stream({"prompt_token_ids": list(ids)})


class RemoteStreams:
    """Streams from an OpenAI-compatible server (``pagedllm serve``, ``vllm serve``) through the openai client."""

    def __init__(self, url: str, model_name: Optional[str], api_key: Optional[str], max_tokens: Optional[int],
                 temperature: Optional[float]):
        import openai  # optional: openai, only for --url

        base = url.rstrip("/")
        self.client = openai.OpenAI(base_url=base if base.endswith("/v1") else base + "/v1",
                                    api_key=api_key or "EMPTY", max_retries=0)
        self.url = base
        try:
            self.model_name = model_name or self.client.models.list().data[0].id
        except openai.APIConnectionError:
            raise ParamError("url", f"cannot connect to {url}; is `pagedllm serve` running there?") from None
        except openai.AuthenticationError:
            raise ParamError("api_key", f"{url} refused the API key (401); pass --api-key") from None
        self.extra = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature)) if v is not None}

    def complete(self, prompt: str) -> Iterator[str]:
        stream = self.client.completions.create(model=self.model_name, prompt=prompt, stream=True, **self.extra)
        with stream:  # closing the HTTP stream makes the server abort the request
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    yield chunk.choices[0].text

    def chat(self, messages: Messages) -> Iterator[str]:
        stream = self.client.chat.completions.create(model=self.model_name, messages=messages, stream=True,
                                                     **self.extra)
        with stream:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content
