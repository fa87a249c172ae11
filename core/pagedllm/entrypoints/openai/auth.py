"""API keys and CORS for ``pagedllm serve`` (vLLM's flag names: ``--api-key``, ``--allowed-origins``, ...).

Keys: ``--api-key K1 K2 ...``, ``--api-key-file PATH`` (one key a line, ``#`` comments) and ``$PAGEDLLM_API_KEY`` (as
vLLM's ``VLLM_API_KEY``) all add up; every key is compared in constant time (``hmac.compare_digest``) and all of them
are compared on every request, so timing tells neither a key's prefix nor which key matched. CORS is closed unless the
operator names origins (vLLM defaults to ``*``; this server does not).
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Iterable, Optional, Sequence

from starlette.middleware.cors import CORSMiddleware

from pagedllm.entrypoints.openai.errors import error_body

API_KEY_ENV = "PAGEDLLM_API_KEY"


def load_api_keys(keys: Optional[Sequence[str]] = None, key_file: Optional[str] = None,
                  env: Optional[dict] = None) -> list[str]:
    """Every configured key, deduplicated, in order; empty means no authentication."""
    env = os.environ if env is None else env
    out: list[str] = []
    for k in keys or ():
        out.append(k)
    if key_file:
        with open(key_file, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    out.append(line)
    if env.get(API_KEY_ENV):
        out.append(env[API_KEY_ENV])
    for k in out:
        if not k or k != k.strip():
            raise ValueError("API keys must be non-empty and carry no surrounding whitespace")
    return list(dict.fromkeys(out))


#: Paths answered without a key: the liveness probe only (``/metrics`` too with ``--allow-metrics-without-key``).
OPEN_PATHS = frozenset({"/health"})


class APIKeyMiddleware:
    """Plain ASGI middleware (no response buffering, so SSE streams pass untouched): every path needs a key except
    ``/health`` (and ``/metrics`` when ``open_metrics``).

    Unlike vLLM, ``/tokenize``, ``/detokenize`` and ``/version`` need the key too: each one that renders or
    tokenises takes a render worker that keyed requests wait for, so an open one lets anyone starve them (issue 34);
    unknown paths answer 401, so probing tells nothing about the routes. The body of a refused request is never
    read (the connection is closed after the 401).
    """

    def __init__(self, app, api_keys: Iterable[str], open_metrics: bool = False):
        self.app = app
        self.expected = [f"Bearer {k}".encode() for k in api_keys]
        self.open_paths = OPEN_PATHS | ({"/metrics"} if open_metrics else set())

    def _ok(self, got: bytes) -> bool:
        ok = False
        for e in self.expected:  # no early exit: the time does not depend on which key matched
            ok |= hmac.compare_digest(got, e)
        return ok

    async def __call__(self, scope, receive, send):
        if (scope["type"] != "http" or scope.get("path", "") in self.open_paths
                or scope.get("method") == "OPTIONS"):
            return await self.app(scope, receive, send)
        got = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                got = v
                break
        if self._ok(got):
            return await self.app(scope, receive, send)
        msg = ("You didn't provide an API key: pass it as 'Authorization: Bearer <key>'." if not got
               else "Incorrect API key provided.")
        body = json.dumps(error_body(401, msg, code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def add_cors(app, allowed_origins: Optional[Sequence[str]], allow_credentials: bool = False,
             allowed_methods: Optional[Sequence[str]] = None, allowed_headers: Optional[Sequence[str]] = None) -> None:
    """CORS only when the operator lists origins (default closed: browsers on other origins get no access)."""
    if not allowed_origins:
        return
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_credentials=allow_credentials,
                       allow_methods=list(allowed_methods or ["*"]), allow_headers=list(allowed_headers or ["*"]))
