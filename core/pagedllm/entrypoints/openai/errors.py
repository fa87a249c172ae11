"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` for every 4xx/5xx the server returns.

Clients (the ``openai`` package included) read ``message``/``param``/``code`` from this shape, so bad input must
never surface as FastAPI's default 422 body or a bare 500.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from pagedllm.errors import ParamError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error"}


class APIError(Exception):
    """Raised by handlers; rendered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: Optional[str] = None, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
               type_: Optional[str] = None) -> dict[str, Any]:
    t = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": t, "param": param, "code": code}}


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code, err.type), status_code=err.status,
                        headers=err.headers)


def from_param_error(e: ParamError, rename: Optional[dict[str, str]] = None) -> APIError:
    """ParamError -> 400 whose ``param`` is the API's field name (``rename`` maps engine names to API names)."""
    field = (rename or {}).get(e.field, e.field)
    msg = str(e)
    if field != e.field and msg.startswith(f"{e.field}:"):
        msg = f"{field}:{msg[len(e.field) + 1:]}"
    return APIError(400, msg, param=field, code="invalid_parameter")


def _loc_name(loc: tuple) -> Optional[str]:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic names union/function branches ("function-after[...]", "str", "list[int]"): keep the field path only.
    parts = [p for p in parts if not any(c in p for c in "[](-") and p not in ("str", "int", "float", "bool")]
    return ".".join(parts) or None


def validation_error(exc: Union[RequestValidationError, ValidationError]) -> APIError:
    errs = exc.errors()
    if not errs:
        return APIError(400, "invalid request body")
    first = errs[0]
    if first.get("type") in ("json_invalid", "json_type"):
        return APIError(400, f"invalid JSON body: {first.get('msg', '')}".rstrip(": "), code="invalid_json")
    param = _loc_name(tuple(first.get("loc", ())))
    msgs = []
    for e in errs[:3]:
        name = _loc_name(tuple(e.get("loc", ()))) or "body"
        msgs.append(f"{name}: {e.get('msg', 'invalid value')}")
    return APIError(400, "; ".join(msgs), param=param, code="invalid_parameter")


def install_handlers(app: FastAPI) -> None:
    """Map every failure path (our errors, pydantic, ParamError, HTTP errors, bugs) to the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(ParamError)
    async def _param(_: Request, exc: ParamError) -> JSONResponse:
        return error_response(from_param_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        return JSONResponse(error_body(exc.status_code, detail), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        # The exception's text may name files or internals: it goes to the log only.
        return JSONResponse(error_body(500, f"internal error ({type(exc).__name__}); the server log has the details"),
                            status_code=500)
