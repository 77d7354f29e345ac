"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`: the body every failure of
the OpenAI-compatible routes gets (errors.py), streamed errors included, and its schema for the
OpenAPI document (Anthropic's is messages_api/protocol.py's)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


# Documented on every route, so the schema says what every 4xx and 5xx looks like (and FastAPI
# adds no 422: validation errors are 400s here).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorResponse, "description": "The request's error (OpenAI-shaped)"},
    "5XX": {"model": ErrorResponse, "description": "The server's error (OpenAI-shaped)"},
}


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict[str, Any]:
    # A message may quote the request (a model name, a template error); keep it encodable as UTF-8.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
