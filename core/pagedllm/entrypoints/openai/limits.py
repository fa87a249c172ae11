"""Request limits enforced before any work: body size, admission (in-flight cap), per-request deadlines.

Why here and not in the engine: a request refused at the door costs the server nothing (no JSON parse, no template
render, no engine slot), and the client learns at once (413 / 429 + ``Retry-After``) instead of waiting in an
unbounded queue. ``--max-num-queued-reqs`` is vLLM's admission flag (in-flight requests, waiting + running; a request
with ``n``/``best_of`` > 1 counts as that many), checked and reserved *before* rendering, so a burst never renders
requests it then refuses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024  # a 128k-token prompt as JSON is < 1 MiB; parsing 8 MiB takes ~50 ms
DEFAULT_MAX_NUM_QUEUED_REQS = 1024
DEFAULT_TEMPLATE_RENDER_TIMEOUT = 5.0
MAX_STOP_STRINGS = 64
MAX_STOP_STR_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # OpenAI's bound on logit_bias entries
MAX_ALLOWED_TOKEN_IDS = 1 << 18
MAX_TOOLS = 128  # OpenAI's bound on tools
MAX_MESSAGES = 4096
MAX_REQUEST_TEMPLATE_CHARS = 256 * 1024


@dataclass(frozen=True)
class ServerLimits:
    """The operator's limits (``pagedllm serve`` flags); ``None`` means unbounded where a flag allows it."""

    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_num_queued_reqs: Optional[int] = DEFAULT_MAX_NUM_QUEUED_REQS
    request_timeout: Optional[float] = None
    template_render_timeout: float = DEFAULT_TEMPLATE_RENDER_TIMEOUT
    trust_request_chat_template: bool = False
    retry_after_s: int = 1

    def max_rendered_chars(self, max_model_len: int) -> int:
        """Cap on a rendered chat prompt's characters: far above any prompt that fits ``max_model_len`` tokens."""
        return max(1 << 20, 64 * max_model_len)


# ---- body size ----------------------------------------------------------------------------------------------------
_JSON_ROUTES = ("/v1/", "/tokenize", "/detokenize")


class RequestBodyMiddleware:
    """Plain ASGI middleware: reads a request body up to ``max_bytes`` (413 past it, before anything parses it).

    The whole (bounded) body is then replayed to the app. A POST to a JSON route whose Content-Type is not JSON
    (``curl -d`` sends form-urlencoded) is marked ``application/json``, so the body is parsed as JSON whatever the
    header says, as before the routes declared their models.
    """

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = list(scope.get("headers", ()))
        for k, v in headers:
            if k == b"content-length":
                try:
                    if int(v) > self.max_bytes:
                        return await self._too_large(send)
                except ValueError:
                    pass
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await self._too_large(send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        data = b"".join(chunks)
        path = scope.get("path", "")
        if path.startswith(_JSON_ROUTES):
            ctype = next((v for k, v in headers if k == b"content-type"), b"")
            if not ctype.split(b";")[0].strip().lower().endswith(b"json"):
                headers = [(k, v) for k, v in headers if k != b"content-type"] + [(b"content-type",
                                                                                   b"application/json")]
                scope = {**scope, "headers": headers}
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()  # later reads: disconnect detection

        return await self.app(scope, replay, send)

    async def _too_large(self, send) -> None:
        from pagedllm.entrypoints.openai.errors import error_body  # heavy: fastapi, not at CLI start

        body = json.dumps(error_body(413, f"request body is larger than the server's limit of {self.max_bytes} "
                                          "bytes (--max-request-body-bytes)", code="request_too_large")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


# ---- admission ----------------------------------------------------------------------------------------------------
class Ticket:
    """Slots one HTTP request holds from admission until its response ends; ``release`` is idempotent."""

    def __init__(self, admission: "Admission", slots: int):
        self.admission = admission
        self.slots = slots

    def release(self) -> None:
        if self.slots:
            self.admission.in_flight -= self.slots
            self.slots = 0


class Admission:
    """Counts in-flight engine sequences; past ``limit`` a request is refused with 429 and ``Retry-After``."""

    def __init__(self, limit: Optional[int], retry_after_s: int = 1, on_reject=None):
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.on_reject = on_reject

    def acquire(self, slots: int, param: str = "n") -> Ticket:
        from pagedllm.entrypoints.openai.errors import APIError  # heavy: fastapi, not at CLI start

        slots = max(int(slots), 1)
        if self.limit is not None:
            if slots > self.limit:
                raise APIError(400, f"{param}: this request needs {slots} sequences, more than the server admits at "
                                    f"once ({self.limit}, --max-num-queued-reqs)", param=param,
                               code="invalid_parameter")
            if self.in_flight + slots > self.limit:
                if self.on_reject is not None:
                    self.on_reject()
                raise APIError(429, f"the server is at its limit of {self.limit} in-flight requests "
                                    "(--max-num-queued-reqs); retry later", code="too_many_requests",
                               headers={"Retry-After": str(self.retry_after_s)})
        self.in_flight += slots
        return Ticket(self, slots)
