"""Request limits enforced before any work: body size, admission (in-flight cap), per-request deadlines.

Why here and not in the engine: a request refused at the door costs the server nothing (no JSON parse, no template
render, no engine slot), and the client learns at once (413 / 429 + ``Retry-After``) instead of waiting in an
unbounded queue. ``--max-num-queued-reqs`` is vLLM's admission flag (in-flight requests, waiting + running; a request
with ``n``/``best_of`` > 1 counts as that many), checked and reserved *before* rendering, so a burst never renders
requests it then refuses.
"""

from __future__ import annotations

import asyncio
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
DEFAULT_MAX_JSON_DEPTH = 64  # a JSON schema or template kwargs nest a dozen levels; pickling fails near 1000
DEFAULT_RENDER_WORKER_MAX_GROWTH = 256 * 1024 * 1024  # resident growth past which a render worker is recycled
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class ServerLimits:
    """The operator's limits (``pagedllm serve`` flags); ``None`` means unbounded where a flag allows it."""

    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_num_queued_reqs: Optional[int] = DEFAULT_MAX_NUM_QUEUED_REQS
    request_timeout: Optional[float] = None
    template_render_timeout: float = DEFAULT_TEMPLATE_RENDER_TIMEOUT
    trust_request_chat_template: bool = False
    retry_after_s: int = 1
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    render_worker_max_growth_bytes: Optional[int] = DEFAULT_RENDER_WORKER_MAX_GROWTH

    def tokenize_body_bytes(self, max_model_len: int) -> int:
        """Body limit of ``/tokenize`` and ``/detokenize``: a prompt of ``max_model_len`` tokens as JSON is well under
        128 bytes a token (even with every character escaped), and a bigger body is refused unread."""
        return min(self.max_request_body_bytes, max(1 << 20, 128 * max_model_len))

    def max_rendered_chars(self, max_model_len: int) -> int:
        """Cap on a rendered chat prompt's (or a text prompt's) characters: far above any prompt that fits
        ``max_model_len`` tokens, so a longer one is refused before a render worker tokenises it."""
        return max(1 << 20, 64 * max_model_len)


# ---- body shape: nesting depth and lone surrogates (checked on the raw bytes, before any parse) -----------------
# Vectorised numpy passes: they release the GIL, so a big body is checked on a thread without holding the loop.
_THREAD_ABOVE = 256 * 1024  # bigger bodies are checked on a thread, off the event loop
_BS, _QUOTE = ord("\\"), ord('"')


def _escaped_backslashes(b):
    """Indices of the backslashes in ``b`` (uint8) escaped by the one before them, and of those before them: in a
    run of backslashes, every second one from its start."""
    import numpy as np  # already loaded by the engine client (torch); not at CLI start

    pos = np.flatnonzero(b == _BS)
    if not pos.size:
        return pos
    starts = np.ones(pos.size, dtype=bool)
    starts[1:] = np.diff(pos) != 1
    first = np.flatnonzero(starts)
    rank = np.arange(pos.size) - first[np.cumsum(starts) - 1]  # place within its run
    second = pos[rank % 2 == 1]
    return np.concatenate((second - 1, second))


def _json_bytes(data: bytes):
    """``data`` as a uint8 array with every escaped backslash pair blanked: a backslash left escapes the next byte."""
    import numpy as np  # already loaded by the engine client (torch); not at CLI start

    b = np.frombuffer(data, dtype=np.uint8)
    pairs = _escaped_backslashes(b)
    if pairs.size:
        b = b.copy()
        b[pairs] = ord("_")
    return b


def json_depth_exceeds(data: bytes, limit: int) -> bool:
    """Whether the JSON text ``data`` nests arrays/objects deeper than ``limit`` (brackets inside strings do not
    count). Works on the positions of quotes and brackets only, so its cost is a few passes over the bytes."""
    import numpy as np  # already loaded by the engine client (torch); not at CLI start

    raw = np.frombuffer(data, dtype=np.uint8)
    opens = np.flatnonzero((raw == ord("[")) | (raw == ord("{")))
    if opens.size <= limit:  # fewer openers cannot nest deeper
        return False
    b = _json_bytes(data)
    quotes = np.flatnonzero(b == _QUOTE)
    quotes = quotes[(quotes == 0) | (b[np.maximum(quotes - 1, 0)] != _BS)]  # not the escaped ones
    closes = np.flatnonzero((raw == ord("]")) | (raw == ord("}")))
    where = np.concatenate((opens, closes))
    step = np.concatenate((np.ones(opens.size, dtype=np.int32), -np.ones(closes.size, dtype=np.int32)))
    order = np.argsort(where, kind="stable")
    where, step = where[order], step[order]
    outside = np.searchsorted(quotes, where) % 2 == 0  # an even number of real quotes before it
    depth = np.cumsum(step[outside])
    return bool(depth.size) and int(depth.max()) > limit


def _surrogate_escapes(b):
    """(high, low): where ``\\uD800``-``\\uDBFF`` and ``\\uDC00``-``\\uDFFF`` escapes start (arrays of len(b) - 5)."""
    head = (b[:-5] == _BS) & (b[1:-4] == ord("u")) & ((b[2:-3] | 0x20) == ord("d"))
    c = b[3:-2] | 0x20  # the second hex digit, lower-cased: 8-b high, c-f low
    high = head & (((c >= ord("8")) & (c <= ord("9"))) | ((c >= ord("a")) & (c <= ord("b"))))
    low = head & (c >= ord("c")) & (c <= ord("f"))
    return high, low


def has_lone_surrogate(data: bytes) -> bool:
    """Whether the JSON text ``data`` escapes a lone UTF-16 surrogate (such as ``\\ud800``), which neither a
    tokenizer nor a UTF-8 response can carry. Escaped pairs (emoji from ``ensure_ascii`` clients) are fine."""
    import numpy as np  # already loaded by the engine client (torch); not at CLI start

    if len(data) < 6:
        return False
    high, low = _surrogate_escapes(np.frombuffer(data, dtype=np.uint8))
    if not (high.any() or low.any()):  # the usual body: no surrogate escape at all
        return False
    high, low = _surrogate_escapes(_json_bytes(data))  # now a backslash before "u" is a real escape
    low_next, high_before = np.zeros_like(low), np.zeros_like(high)
    low_next[:-6], high_before[6:] = low[6:], high[:-6]  # an escape is 6 bytes: a pair is high at i, low at i + 6
    return bool((high & ~low_next).any() or (low & ~high_before).any())


def body_problem(data: bytes, max_depth: int) -> Optional[tuple[str, str]]:
    """(message, code) of a body that must be refused before parsing, else None."""
    if json_depth_exceeds(data, max_depth):
        return (f"the request body nests JSON arrays/objects deeper than the server's limit of {max_depth} levels "
                "(--max-json-depth)", "json_too_deep")
    if has_lone_surrogate(data):
        return ("the request body contains a lone UTF-16 surrogate escape (such as \\ud800 without its pair); "
                "text must be valid Unicode", "invalid_unicode")
    return None


# ---- body size ----------------------------------------------------------------------------------------------------
_JSON_ROUTES = ("/v1/", "/tokenize", "/detokenize")


class RequestBodyMiddleware:
    """Plain ASGI middleware: reads a request body up to ``max_bytes`` (413 past it, before anything parses it;
    ``route_max_bytes`` lowers the limit for some paths), then refuses (400) one that nests JSON deeper than
    ``max_json_depth`` or escapes a lone surrogate, still before the app parses it.

    The whole (bounded) body is then replayed to the app. A POST to a JSON route whose Content-Type is not JSON
    (``curl -d`` sends form-urlencoded) is marked ``application/json``, so the body is parsed as JSON whatever the
    header says, as before the routes declared their models.
    """

    def __init__(self, app, max_bytes: int, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH,
                 route_max_bytes: Optional[dict[str, int]] = None):
        self.app = app
        self.max_bytes = max_bytes
        self.route_max_bytes = dict(route_max_bytes or {})
        self.max_json_depth = max_json_depth

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        headers = list(scope.get("headers", ()))
        limit = self.route_max_bytes.get(scope.get("path", ""), self.max_bytes)
        for k, v in headers:
            if k == b"content-length":
                try:
                    if int(v) > limit:
                        return await self._too_large(send, limit)
                except ValueError:
                    pass
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > limit:
                return await self._too_large(send, limit)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        data = b"".join(chunks)
        path = scope.get("path", "")
        if path.startswith(_JSON_ROUTES):
            problem = (body_problem(data, self.max_json_depth) if len(data) < _THREAD_ABOVE
                       else await asyncio.to_thread(body_problem, data, self.max_json_depth))
            if problem is not None:
                return await _send_error(send, 400, *problem)
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

    async def _too_large(self, send, limit: int) -> None:
        why = ("--max-request-body-bytes" if limit == self.max_bytes
               else "this route's limit, from max_model_len and --max-request-body-bytes")
        await _send_error(send, 413, f"request body is larger than the server's limit of {limit} bytes ({why})",
                          "request_too_large", close=True)


async def _send_error(send, status: int, message: str, code: str, close: bool = False) -> None:
    from pagedllm.entrypoints.openai.errors import error_body  # heavy: fastapi, not at CLI start

    body = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status,
                "headers": headers + ([(b"connection", b"close")] if close else [])})
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
