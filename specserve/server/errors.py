"""OpenAI-shaped errors: the `APIError` exception, FastAPI handlers, and the body-size limit.

What it does: every error the server returns has the body
`{"error": {"message", "type", "param", "code"}}` and the right status code, including FastAPI's own
404/405 and anything unexpected (500, logged with its traceback; the body names nothing internal). `BodySizeLimitMiddleware` answers 413
for a body over the limit, whether or not the client sent Content-Length. `read_body` reads a request's
body (499 when the client left meanwhile), for the server and the gateway alike.
What it does not do: decide which request values are invalid (see `protocol.py`).
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

logger = logging.getLogger("specserve.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "server_overloaded",
}


class APIError(Exception):
    """Raise anywhere in a handler to return an OpenAI-shaped error."""

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
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def internal_error(rid: str) -> APIError:
    """The 500 for a failure inside the engine: not the client's fault, and nothing internal in the body
    (whoever caught the exception logs its traceback)."""
    return APIError(500, f"internal error while generating {rid}; the server log has the details",
                    code="internal_error")


class BodyTooLarge(Exception):
    """Raised by the size-limited `receive` when a chunked body passes the limit."""


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object. `code` is a machine-readable reason such as "context_length_exceeded", or
    null when there is none beyond the HTTP status (as OpenAI sends it); `type` follows the status."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error"),
            "param": param,
            "code": code,
        }
    }


async def read_body(request: Request) -> bytes:
    """The request's body bytes (the server's and the gateway's). Raises APIError 499 when the client
    disconnected while sending it."""
    try:
        return await request.body()
    except ClientDisconnect:
        raise APIError(499, "client disconnected while sending the request") from None


def error_response(status: int, message: str, **kw) -> JSONResponse:
    headers = kw.pop("headers", None)
    return JSONResponse(error_body(status, message, **kw), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception type to an OpenAI-shaped JSON error."""

    @app.exception_handler(APIError)
    async def _api_error(_req: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(_req: Request, exc: BodyTooLarge):
        return error_response(413, str(exc) or "request body too large", code="request_too_large")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            msg = f"not found: {req.method} {req.url.path}"
        return error_response(exc.status_code, msg, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation(_req: Request, exc: RequestValidationError):
        return error_response(400, validation_message(exc.errors()), param=validation_param(exc.errors()))

    @app.exception_handler(Exception)
    async def _unexpected(req: Request, exc: Exception):
        logger.error("unhandled error on %s %s", req.method, req.url.path, exc_info=exc)
        return error_response(500, "internal server error; the server log has the details", code="internal_error")


def validation_message(errors: list[dict]) -> str:
    """One readable line from pydantic errors: 'max_tokens: Input should be a valid integer; ...'."""
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {e.get('msg')}" if loc else str(e.get("msg")))
    return "; ".join(parts) or "invalid request"


def validation_param(errors: list[dict]) -> str | None:
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if loc:
            return loc[0]
    return None


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: 413 for a declared Content-Length over `max_bytes`; a chunked body that
    grows past it raises BodyTooLarge from `receive` (turned into 413 by the handler above)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    resp = error_response(
                        413, f"request body of {declared} bytes exceeds the limit of {self.max_bytes} bytes",
                        code="request_too_large",
                    )
                    # drain nothing: answer at once and close (Connection: close keeps the stream sane)
                    resp.headers["connection"] = "close"
                    return await resp(scope, receive, send)
        seen = 0
        limit = self.max_bytes

        async def limited_receive():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
            return msg

        return await self.app(scope, limited_receive, send)
