"""Replies in Anthropic's shapes: a whole message, or the stream's events (message_start,
content_block_start/delta/stop, message_delta, message_stop). A reply's tool calls are read by the
same parser as the chat API's (tool_calls/parser.py), so a message and its stream agree."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tandem.outputs import CompletionOutput, RequestOutput
from tandem.serve.errors import anthropic_error_body as error_body
from tandem.serve.reasoning import ReasoningFormat, split_reply
from tandem.serve.reply_parser import ReplyParser
from tandem.serve.tool_calls.formats import ToolFormat
from tandem.serve.tool_calls.parser import parse_reply


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(out: CompletionOutput, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence): what ended the reply, in Anthropic's words."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if out.finish_reason != "stop":
        return None, None
    if called:
        return "tool_use", None
    if isinstance(out.stop_reason, str):
        return "stop_sequence", out.stop_reason
    return "end_turn", None


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict[str, Any]:
    # Anthropic counts the prompt's cached tokens apart: input_tokens are the ones computed.
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0}


def _tool_use(call_id: str, name: str | None, arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        value = {}
    return {"type": "tool_use", "id": tool_use_id(call_id), "name": name,
            "input": value if isinstance(value, dict) else {}}


@dataclass(frozen=True)
class Reply:
    """How one reply is shown: its model name and id, the tool-call format its calls are read in (None:
    all text), and how its reasoning is set apart (None: no thinking blocks)."""

    model: str
    id: str
    tools: ToolFormat | None = None
    reasoning: ReasoningFormat | None = None
    reasoning_opened: bool = False  # the prompt ended inside the reasoning


def message(reply: Reply, final: RequestOutput) -> dict[str, Any]:
    """The whole reply as a Messages response."""
    out = final.outputs[0]
    content: list[dict[str, Any]] = []
    text = out.text
    if reply.reasoning is not None:
        split = split_reply(reply.reasoning, text, reply.reasoning_opened)
        if split.reasoning:
            content.append({"type": "thinking", "thinking": split.reasoning, "signature": ""})
        text = split.content
    called = False
    if reply.tools is None:
        if text:
            content.append({"type": "text", "text": text})
    else:
        parsed = parse_reply(reply.tools, text)
        if parsed.content:
            content.append({"type": "text", "text": parsed.content})
        content += [_tool_use(c.id or "", c.name, c.arguments) for c in parsed.calls]
        called = bool(parsed.calls)
    reason, sequence = stop_reason(out, called)
    return {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage(len(final.prompt_token_ids), final.num_cached_tokens, len(out.token_ids))}


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name} | data)}\n\n"


class BlockStream:
    """The stream's content blocks: a thinking block for the reasoning, a text block for content, a
    tool_use block per call, each opened when its first piece arrives and closed when the next block
    starts or the reply ends."""

    def __init__(self, reply: Reply) -> None:
        self.reply = ReplyParser(reply.tools, reply.reasoning, reply.reasoning_opened)
        self.index = -1
        self.open: str | None = None  # "thinking" | "text" | "tool_use"
        self.calls = 0

    def feed(self, text: str, final: bool) -> list[str]:
        events: list[str] = []
        piece = self.reply.feed(text, final)
        if piece.reasoning:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""}, "thinking")
            events.append(event("content_block_delta", {
                "index": self.index, "delta": {"type": "thinking_delta", "thinking": piece.reasoning}}))
        delta = piece.delta
        if delta.content:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""}, "text")
            events.append(event("content_block_delta", {"index": self.index,
                                                        "delta": {"type": "text_delta", "text": delta.content}}))
        for call in delta.calls:
            if call.id is not None:
                self.calls += 1
                events += self._start(_tool_use(call.id, call.name, "") | {"input": {}}, "tool_use")
            if call.arguments:
                events.append(event("content_block_delta", {
                    "index": self.index, "delta": {"type": "input_json_delta", "partial_json": call.arguments}}))
        if final:
            events += self._close()
        return events

    def _start(self, block: dict[str, Any], kind: str) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = kind
        return [*events, event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [event("content_block_stop", {"index": self.index})]


async def message_events(outputs: AsyncIterator[tuple[int, RequestOutput]], reply: Reply) -> AsyncIterator[str]:
    """One reply's stream of events. message_start goes with the first output, which knows how much of
    the prompt was cached; an engine error or a timeout ends the stream with an error event."""
    blocks = BlockStream(reply)
    started = False
    output_tokens = 0
    last: RequestOutput | None = None
    try:
        async for _, item in outputs:
            last = item
            out = item.outputs[0]
            text, tokens = item.deltas[0] if item.deltas else ("", [])
            output_tokens += len(tokens)
            if not started:
                started = True
                start = {"id": reply.id, "type": "message", "role": "assistant", "model": reply.model, "content": [],
                         "stop_reason": None, "stop_sequence": None,
                         "usage": usage(len(item.prompt_token_ids), item.num_cached_tokens, 0)}
                yield event("message_start", {"message": start})
                yield event("ping", {})
            for e in blocks.feed(text, item.finished or out.finish_reason is not None):
                yield e
    except TimeoutError:
        yield event("error", error_body("request timed out", 408))
        return
    except Exception as e:  # an engine error: the stream ends with Anthropic's error event
        yield event("error", error_body(str(e), 500))
        return
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    if last is None:
        yield event("error", error_body("the engine returned no output", 500))
        return
    reason, sequence = stop_reason(last.outputs[0], blocks.calls > 0)
    totals = usage(len(last.prompt_token_ids), last.num_cached_tokens, output_tokens)
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence}, "usage": totals})
    yield event("message_stop", {})
