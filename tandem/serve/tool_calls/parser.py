"""The model's text -> content and tool calls, incrementally: fed each streamed text delta, it says
what may be sent now (content, a call's id and name, more of its arguments), holding back only what
could still turn out to be part of a call. A whole reply is parsed by feeding it at once, so a
response and its stream always agree.

A call's arguments are sent as the model wrote them (their raw JSON text), character by character
as they arrive, once the call's name is known; a call written in another key order is sent whole
when its object closes. Text that looked like a call but is not one (no name, broken JSON) goes
back to the content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from tandem.serve.tool_calls.formats import ToolFormat

# A call's header, `{"name": "...", "arguments":`, is looked for in its first characters only; past
# these, the call is parsed when it closes.
_HEADER_SCAN_LIMIT = 512


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


@dataclass
class Delta:
    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)

    def add_args(self, index: int, text: str) -> None:
        if not text:
            return
        if self.calls and self.calls[-1].index == index:
            self.calls[-1].arguments += text
        else:
            self.calls.append(ToolCallDelta(index, arguments=text))

    def extend(self, other: Delta) -> None:
        self.content += other.content
        for c in other.calls:
            if c.id is None:
                self.add_args(c.index, c.arguments)
            else:
                self.calls.append(c)


@dataclass
class _Call:
    """One call object being read: its raw text, JSON nesting, and where its arguments lie."""

    raw: str = ""  # everything since the open tag (or the call's start), whitespace included
    text: str = ""  # the object, from its `{`
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    header_done: bool = False
    args_start: int | None = None  # in text
    args_kind: str = ""  # the value's first character: { [ " or a scalar's
    args_end: int | None = None
    emitted: int = 0  # characters of the arguments sent so far (from args_start)
    index: int = -1  # set with the header
    name: str | None = None
    announced: bool = False  # its id and name were sent

    @property
    def complete(self) -> bool:
        return bool(self.text) and self.depth == 0


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallParser:
    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        keys = "|".join(re.escape(k) for k in fmt.args_keys)
        self._header = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:' + keys + r')"\s*:\s*')
        self._buf = ""
        self._pending_ws = ""  # whitespace-only content, sent with the next real content
        self._call: _Call | None = None
        self._state = "start" if fmt.open is None else "content"
        self._opened = False  # past the marker (and an array's bracket): the next call starts straight away
        self.num_calls = 0

    # -- public ---------------------------------------------------------------------------------
    def feed(self, text: str) -> Delta:
        self._buf += text
        out = Delta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Delta:
        """The end of the reply: whatever was held back, resolved."""
        out = Delta()
        while self._step(out, final=True):
            pass
        call = self._call
        if call is not None:  # the reply ended inside a call (max_tokens, a stop string)
            if call.header_done:
                self._emit_args(call, out, len(call.text))
            else:
                self._content(out, call.raw)
            self._call = None
        if self._buf:
            self._content(out, self._buf)
            self._buf = ""
        if self._pending_ws and not self.num_calls:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    # -- states ---------------------------------------------------------------------------------
    def _step(self, out: Delta, final: bool) -> bool:
        """Consume what can be decided now; True if the state moved (run again)."""
        fmt = self.fmt
        if self._state == "start":  # calls start the reply: look past whitespace, the prefix, a bracket
            head = self._buf.lstrip()
            if not self._opened:
                marked = bool(fmt.prefix) and head.startswith(fmt.prefix)
                if marked:
                    head = head[len(fmt.prefix):].lstrip()
                elif fmt.prefix and fmt.prefix.startswith(head) and head and not final:
                    return False  # maybe the prefix, still arriving
                elif fmt.prefix_required and (head or final):
                    self._state = "content"
                    return bool(self._buf)
                if fmt.array and (head or final):
                    if not head.startswith("["):
                        self._state = "content"
                        return bool(self._buf)
                    head = head[1:].lstrip()
            if not head and not final:
                return False
            if head.startswith("{"):
                self._opened = True
                self._start_call(self._buf[:len(self._buf) - len(head)])
                self._buf = head
                return True
            self._state = "content"
            return bool(self._buf)
        if self._state == "content":
            if not self._buf:
                return False
            if fmt.open is None:  # no calls after content in this format
                self._content(out, self._buf)
                self._buf = ""
                return False
            i = self._buf.find(fmt.open)
            if i >= 0:
                self._content(out, self._buf[:i])
                self._start_call(fmt.open)
                self._buf = self._buf[i + len(fmt.open):]
                return True
            keep = 0 if final else _partial_suffix(self._buf, fmt.open)
            self._content(out, self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        if self._state == "call":
            return self._read_call(out, final)
        assert self._state == "after"
        return self._after_call(final)

    def _start_call(self, raw: str) -> None:
        self._call = _Call(raw=raw)
        self._state = "call"

    def _read_call(self, out: Delta, final: bool) -> bool:
        call = self._call
        assert call is not None
        i = 0
        buf = self._buf
        while i < len(buf) and not call.complete:
            c = buf[i]
            i += 1
            call.raw += c
            if not call.text:
                if c.isspace():
                    continue
                if c != "{":  # not a JSON object: this was content after all
                    self._buf = buf[i:]
                    self._call = None
                    self._state = "content"
                    self._content(out, call.raw)
                    return True
            call.text += c
            self._scan(call, c)
        self._buf = buf[i:]
        if call.header_done:
            self._emit_args(call, out, call.args_end if call.args_end is not None else self._safe_args_end(call))
        if not call.complete:
            return False
        self._close_call(call, out)
        self._state = "after"
        return True

    def _scan(self, call: _Call, c: str) -> None:
        if call.in_string:
            if call.escaped:
                call.escaped = False
            elif c == "\\":
                call.escaped = True
            elif c == '"':
                call.in_string = False
                if call.args_kind == '"' and call.depth == 1 and call.args_end is None:
                    call.args_end = len(call.text)
            return
        if c == '"':
            call.in_string = True
        elif c in "{[":
            call.depth += 1
        elif c in "}]":
            call.depth -= 1
            if call.args_kind in ("{", "[") and call.depth == 1 and call.args_end is None:
                call.args_end = len(call.text)
        if call.header_done and call.args_start is not None and call.args_end is None and \
                call.args_kind not in ("{", "[", '"') and call.depth <= 1 and c in ",}":
            call.args_end = len(call.text) - 1  # a scalar ends at the next delimiter
            while call.args_end > call.args_start and call.text[call.args_end - 1].isspace():
                call.args_end -= 1
        if not call.header_done and len(call.text) <= _HEADER_SCAN_LIMIT and not c.isspace():
            m = self._header.match(call.text)
            if m is not None and m.end() == len(call.text):
                call.header_done = True
                call.args_start = len(call.text)
                call.index = self.num_calls
                self.num_calls += 1
                call.name = json.loads(f'"{m.group(1)}"')
        elif call.header_done and call.args_start is not None and not call.args_kind:
            if c.isspace() and len(call.text) - 1 == call.args_start:
                call.args_start += 1  # whitespace before the value
            else:
                call.args_kind = c
                call.args_start = len(call.text) - 1

    def _safe_args_end(self, call: _Call) -> int:
        if call.args_start is None or not call.args_kind:
            return call.args_start or 0
        if call.args_kind in ("{", "[", '"'):
            return len(call.text)
        return call.args_start  # a scalar is sent when it ends

    def _emit_args(self, call: _Call, out: Delta, end: int) -> None:
        assert call.args_start is not None
        if not call.announced:
            out.calls.append(ToolCallDelta(call.index, new_call_id(), call.name))
            call.announced = True
        start = call.args_start + call.emitted
        if end > start:
            out.add_args(call.index, call.text[start:end])
            call.emitted = end - call.args_start

    def _close_call(self, call: _Call, out: Delta) -> None:
        self._call = None
        if call.header_done:
            if call.args_end is None:  # a value the scanner could not delimit: send the rest of it
                body = call.text[call.args_start:].rstrip().removesuffix("}").rstrip()
                self._emit_args(call, out, (call.args_start or 0) + len(body))
            return
        try:
            obj = json.loads(call.text)
        except json.JSONDecodeError:
            obj = None
        args = next((obj[k] for k in self.fmt.args_keys if isinstance(obj, dict) and k in obj), None)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args is None:
            self._content(out, call.raw)
            return
        out.calls.append(ToolCallDelta(self.num_calls, new_call_id(), obj["name"], json.dumps(args)))
        self.num_calls += 1

    def _after_call(self, final: bool) -> bool:
        """Past a call's object: its close tag (hermes), or a separator and the next call (llama3, mistral),
        or the array's end (mistral)."""
        fmt = self.fmt
        head = self._buf.lstrip()
        if fmt.close is not None:
            if head.startswith(fmt.close):
                self._buf = head[len(fmt.close):]
                self._state = "content"
                return True
            if head and fmt.close.startswith(head) and not final:
                return False  # the tag, still arriving
            if not head and not final:
                return False
            self._state = "content"  # no close tag: tolerated
            return True
        if not head and not final:
            return False
        if head.startswith(fmt.separator.strip()):
            self._buf = head[len(fmt.separator.strip()):]
            self._state = "start"
            return True
        if fmt.array and head.startswith("]"):  # the array's end: what follows is content
            self._buf = head[1:]
            self._state = "content"
            return True
        self._state = "content"
        return bool(self._buf)

    # -- helpers --------------------------------------------------------------------------------
    def _content(self, out: Delta, text: str) -> None:
        if not text:
            return
        # Trailing whitespace waits for more content: before a call it is dropped, so a reply and
        # its stream agree however the text was split.
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        out.content += self._pending_ws + body
        self._pending_ws = text[len(body):]


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that starts tag (it may be the tag, half arrived)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass
class ParsedReply:
    content: str | None
    calls: list[ToolCallDelta]  # one per call, arguments whole


def parse_reply(fmt: ToolFormat, text: str) -> ParsedReply:
    parser = ToolCallParser(fmt)
    out = parser.feed(text)
    out.extend(parser.finish())
    calls: dict[int, ToolCallDelta] = {}
    for d in out.calls:
        if d.id is not None:
            calls[d.index] = ToolCallDelta(d.index, d.id, d.name, d.arguments)
        else:
            calls[d.index].arguments += d.arguments
    content = out.content if out.content.strip() or not calls else None
    return ParsedReply(content, [calls[i] for i in sorted(calls)])
