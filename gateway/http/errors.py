"""OpenAI-shaped errors: every failure leaves the server as {"error": {message, type, param, code}}.

Clients (the official `openai` SDK included) parse this shape to raise typed exceptions, so every
path — validation, auth, admission, unknown routes, engine failures — must produce it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanokv.errors import NanoKVError

log = logging.getLogger("nanokv.gateway.http")

# status -> (type, default code) following what api.openai.com answers
_KINDS: dict[int, tuple[str, str | None]] = {
    400: ("invalid_request_error", "invalid_value"),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "engine_unavailable"),
}


class OpenAIError(Exception):
    """Raised anywhere in a handler; rendered by the app's exception handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code if code is not None else _KINDS.get(status, ("invalid_request_error", None))[1]
        self.headers = headers or {}

    @classmethod
    def from_nanokv(cls, err: NanoKVError) -> OpenAIError:
        return cls(400, f"{err.field}: {err.message}", param=err.field)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None
               ) -> dict[str, dict[str, str | None]]:
    kind, default_code = _KINDS.get(status, ("invalid_request_error", None))
    return {"error": {"message": message, "type": kind, "param": param, "code": code or default_code}}


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param, err.code), err.status, err.headers)


def install_error_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Route every exception type to the OpenAI shape. `on_error(status)` feeds a metrics counter."""

    def respond(err: OpenAIError) -> JSONResponse:
        if on_error is not None:
            on_error(err.status)
        return error_response(err)

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, exc: OpenAIError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(NanoKVError)
    async def _nanokv(_: Request, exc: NanoKVError) -> JSONResponse:
        return respond(OpenAIError.from_nanokv(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return respond(OpenAIError(exc.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # Details go to the log, not to the client: internals are no business of a tenant.
        log.exception("unhandled error in request handler")
        return respond(OpenAIError(500, f"internal error ({type(exc).__name__}); see server log"))
