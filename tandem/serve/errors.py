"""Errors: the exception endpoints raise, the handlers that turn every failure into OpenAI's body,
`{"error": {"message", "type", "param", "code"}}` (Anthropic's under /v1/messages), and one log line
per error with the request's id."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tandem.disagg.router.engine_client import EngineDeadError, EngineRequestError
from tandem.serve.error_shape import error_body

log = logging.getLogger("tandem.serve.api")

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
               405: "MethodNotAllowedError", 408: "TimeoutError", 413: "RequestTooLargeError",
               429: "RateLimitError", 499: "ClientClosedRequest", 500: "InternalServerError",
               503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


ANTHROPIC_PREFIX = "/v1/messages"  # every error under it is in Anthropic's shape

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                         500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`: a response's body, or a stream's error event."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_type(status: int) -> str:
    """OpenAI's error type for a status."""
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "BadRequestError", param)


def request_id(scope: Mapping[str, Any]) -> str:
    return scope.get("state", {}).get("request_id", "-")


def error_response(scope: Mapping[str, Any], status: int, message: str, type_: str | None = None,
                   param: str | None = None, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The error's response, in the shape of the API the path belongs to, and its one log line (a
    client's error is INFO: it is not the server's)."""
    type_ = type_ or error_type(status)
    rid = request_id(scope)
    log.log(logging.INFO if status < 500 else logging.ERROR, "request %s: %d %s: %s", rid, status, type_, message)
    if str(scope.get("path", "")).startswith(ANTHROPIC_PREFIX):
        return JSONResponse(anthropic_error_body(message, status), status, headers=headers)
    return JSONResponse(error_body(message, type_, status, param), status, headers=headers)


def validation_message(request: Request, e: RequestValidationError) -> tuple[str, str | None]:
    """One sentence for pydantic's first complaint, and the field it names."""
    err = e.errors()[0] if e.errors() else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return f"the request body is not valid JSON: {err.get('ctx', {}).get('error', 'decode error')}", None
    if not loc and kind in ("model_attributes_type", "dict_type", "missing"):
        content_type = request.headers.get("content-type", "")
        if "json" not in content_type.lower():
            return f"Content-Type must be application/json (got {content_type or 'none'!r})", None
        return "the request body must be a JSON object", None
    message = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    if not loc:
        return message, None
    if message.startswith(f"{loc[-1]} "):  # our validators' messages already begin with the field
        return ".".join(loc) + message[len(loc[-1]):], loc[0]
    return f"{'.'.join(loc)}: {message}", loc[0]


def http_message(request: Request, e: HTTPException) -> str:
    if e.status_code == 404:
        return f"no route {request.method} {request.url.path}"
    if e.status_code == 405:
        allowed = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow", "")
        return f"{request.method} is not allowed on {request.url.path} (allowed: {allowed})"
    cause = e.__cause__  # FastAPI reports every body it cannot parse as one generic 400
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (byte {cause.object[cause.start]:#04x} at {cause.start})"
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply"
    return str(e.detail)


def install_error_handlers(app: FastAPI) -> None:
    """Everything a handler can raise; what none of these catches is RequestIdMiddleware's 500."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(request.scope, e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(request, e)
        return error_response(request.scope, 400, message, "BadRequestError", param)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return error_response(request.scope, e.status_code, http_message(request, e),
                              headers=e.headers)

    # Engine failures map to 500/503 with a message; the server keeps serving.
    @app.exception_handler(EngineRequestError)
    async def _engine_error(request: Request, e: EngineRequestError) -> JSONResponse:
        return error_response(request.scope, 500, str(e))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, e: EngineDeadError) -> JSONResponse:
        return error_response(request.scope, 503, str(e))
