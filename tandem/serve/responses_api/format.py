"""Replies in the Responses API's shapes: the response object (output items: reasoning, an assistant
message, function calls; usage with cached tokens) and its stream of events. The reasoning and tool-call
parsers are the chat API's, so a response and its stream agree."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tandem.outputs import RequestOutput
from tandem.serve.errors import error_type
from tandem.serve.reasoning import ReasoningFormat
from tandem.serve.reply_parser import ReplyParser
from tandem.serve.tool_calls.formats import ToolFormat


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


@dataclass
class Shown:
    """How one response is shown, and its output items as they are built (whole or streamed)."""

    id: str
    model: str
    request: dict[str, Any]  # the request's fields a response echoes (instructions, tools, text, ...)
    tools: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None
    reasoning_opened: bool = False
    created_at: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)

    def body(self, status: str, final: RequestOutput | None = None, output_tokens: int = 0) -> dict[str, Any]:
        usage = None
        incomplete = None
        if final is not None:
            prompt = len(final.prompt_token_ids)
            usage = {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                     "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": prompt + output_tokens}
            if final.outputs[0].finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "model": self.model, "output": self.output, "usage": usage, "incomplete_details": incomplete,
                "error": None, **self.request}


class ItemStream:
    """The reply's text as output items: a reasoning item, an assistant message, a function call per
    call, each added when its first piece arrives and done when the next starts or the reply ends.
    `feed` returns the stream's events (without sequence numbers)."""

    def __init__(self, shown: Shown) -> None:
        self.shown = shown
        self.reply = ReplyParser(shown.tools, shown.reasoning, shown.reasoning_opened)
        self.open: dict[str, Any] | None = None

    @property
    def calls(self) -> int:
        return sum(1 for item in self.shown.output if item["type"] == "function_call")

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        piece = self.reply.feed(text, final)
        if piece.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._add({"type": "reasoning", "id": new_id("rs"), "summary": [],
                                     "content": [{"type": "reasoning_text", "text": ""}]})
            events.append(self._text_delta("response.reasoning_text.delta", piece.reasoning))
        delta = piece.delta
        if delta.content:
            if self.open is None or self.open["type"] != "message":
                events += self._add({"type": "message", "id": new_id("msg"), "status": "in_progress",
                                     "role": "assistant", "content": []})
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                self.open["content"].append(part)
                events.append({"type": "response.content_part.added", "item_id": self.open["id"],
                               "output_index": len(self.shown.output) - 1, "content_index": 0, "part": dict(part)})
            events.append(self._text_delta("response.output_text.delta", delta.content))
        for call in delta.calls:
            if call.id is not None:
                events += self._add({"type": "function_call", "id": new_id("fc"), "call_id": call.id,
                                     "name": call.name, "arguments": "", "status": "in_progress"})
            if call.arguments:
                assert self.open is not None
                self.open["arguments"] += call.arguments
                events.append({"type": "response.function_call_arguments.delta", "item_id": self.open["id"],
                               "output_index": len(self.shown.output) - 1, "delta": call.arguments})
        if final:
            events += self._done()
        return events

    def _text_delta(self, kind: str, text: str) -> dict[str, Any]:
        assert self.open is not None
        self.open["content"][0]["text"] += text
        return {"type": kind, "item_id": self.open["id"], "output_index": len(self.shown.output) - 1,
                "content_index": 0, "delta": text, **({"logprobs": []} if kind.endswith("output_text.delta") else {})}

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._done()
        self.shown.output.append(item)
        self.open = item
        return [*events, {"type": "response.output_item.added", "output_index": len(self.shown.output) - 1,
                          "item": json.loads(json.dumps(item))}]

    def _done(self) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.shown.output) - 1
        events: list[dict[str, Any]] = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "text": part["text"], "logprobs": []},
                       {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)}]
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "text": item["content"][0]["text"]})
        else:
            events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                           "output_index": index, "arguments": item["arguments"]})
        if "status" in item:
            item["status"] = "completed"
        return [*events, {"type": "response.output_item.done", "output_index": index,
                          "item": json.loads(json.dumps(item))}]


def whole(shown: Shown, final: RequestOutput) -> dict[str, Any]:
    """The whole reply as a response object (the stream's items, fed at once)."""
    ItemStream(shown).feed(final.outputs[0].text, final=True)
    return shown.body("completed", final, len(final.outputs[0].token_ids))


async def response_events(outputs: AsyncIterator[tuple[int, RequestOutput]], shown: Shown,
                          done: Any) -> AsyncIterator[str]:
    """The stream: response.created and .in_progress, each item's events, then response.completed
    (or .incomplete at max_output_tokens). `done(final, body)` is told the finished response (to store
    it). A timeout or an engine error ends the stream with an error event."""
    sequence = 0

    def sse(event: dict[str, Any]) -> str:
        nonlocal sequence
        event["sequence_number"] = sequence
        sequence += 1
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    items = ItemStream(shown)
    yield sse({"type": "response.created", "response": shown.body("in_progress")})
    yield sse({"type": "response.in_progress", "response": shown.body("in_progress")})
    last: RequestOutput | None = None
    output_tokens = 0
    try:
        async for _, item in outputs:
            last = item
            text, tokens = item.deltas[0] if item.deltas else ("", [])
            output_tokens += len(tokens)
            for event in items.feed(text, item.finished or item.outputs[0].finish_reason is not None):
                yield sse(event)
    except TimeoutError:
        yield sse({"type": "error", "code": error_type(408), "message": "request timed out", "param": None})
        return
    except Exception as e:  # an engine error ends the stream with the API's error event
        yield sse({"type": "error", "code": error_type(500), "message": str(e), "param": None})
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    if last is None:
        return
    body = shown.body("completed", last, output_tokens)
    done(last, body)
    yield sse({"type": f"response.{body['status']}", "response": body})
