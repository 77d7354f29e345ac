"""Pure-ASGI layers around the API (not BaseHTTPMiddleware, so that handlers still see client
disconnects): a request id on every request and response, the last-resort 500, the body limit, the
API key."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from starlette.exceptions import HTTPException

from tandem.serve.errors import error_response

log = logging.getLogger("tandem.serve.api")


class RequestIdMiddleware:
    """Every request gets an id: the `X-Request-Id` response header, and the key of each log line
    about it. An exception that no handler took becomes one log line (the traceback only at DEBUG)
    and an OpenAI-shaped 500, not a page of traceback from the ASGI server."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            message = f"internal server error: {type(e).__name__}: {e}"
            log.debug("request %s: traceback", rid, exc_info=True)
            if started:  # mid-stream: the client sees the connection close
                log.error("request %s: 500 after the response started: %s", rid, message)
                return
            await error_response(scope, 500, message)(scope, receive, send_with_id)


class BodyTooLarge(HTTPException):
    # An HTTPException, so that FastAPI's body reader passes it to the handlers instead of
    # turning it into a generic "error parsing the body" 400.
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the server's limit of {limit} bytes")


class BodyLimitMiddleware:
    """413 for a body over `max_bytes`: by Content-Length before reading any of it, and by counting
    the chunks as they arrive (a chunked upload has no length)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            e = BodyTooLarge(self.max_bytes)
            await error_response(scope, 413, e.detail)(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)


PROTECTED_PREFIXES = ("/v1", "/tokenize", "/detokenize")  # everything that does work for a caller


class APIKeyMiddleware:
    """API-key check (a bearer token or x-api-key) on the endpoints that do work (and /metrics, if
    asked). Pure ASGI (not BaseHTTPMiddleware), so that handlers still see client disconnects. Each
    key is a tenant: its salt keeps its prefix-cache blocks its own and names it to the fair scheduler."""

    def __init__(self, app: Any, key_salts: dict[str, str], protect_metrics: bool = False) -> None:
        self.app = app
        self.key_salts = key_salts
        self.prefixes = PROTECTED_PREFIXES + (("/metrics",) if protect_metrics else ())

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefixes):
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"").decode(errors="replace")
            # A bearer token (OpenAI's clients) or x-api-key (Anthropic's).
            key = header[7:] if header.lower().startswith("bearer ") else \
                headers.get(b"x-api-key", b"").decode(errors="replace") or None
            if key not in self.key_salts:
                response = error_response(scope, 401, "invalid or missing API key", "AuthenticationError")
                await response(scope, receive, send)
                return
            scope.setdefault("state", {})["salt"] = self.key_salts[key]
        await self.app(scope, receive, send)
