"""gpt-oss's harmony format: a reply is messages, each a header and a body between special tokens,

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "P"}<|call|>
    <|start|>assistant<|channel|>final<|message|>...the answer...<|return|>

and this parser reads it incrementally: fed each streamed text delta (detokenized with its special tokens),
it gives the analysis channel as reasoning, the final channel (and commentary addressed to no one, a
preamble) as content, and a message addressed `to=functions.NAME` as a tool call whose arguments are its
body, sent as they arrive. Only what could still be the start of a special token is held back; a whole
reply is parsed by feeding it at once, so a response and its stream agree. Text before any header (a
model that skipped the format) is content. One module for both of vLLM's names for it, the reasoning
parser `openai_gptoss` and the tool-call parser `openai` (tandem/serve/reply_parser.py).
"""

from __future__ import annotations

import re

from tandem.serve.reasoning import Split
from tandem.serve.tool_calls.parser import Delta, ToolCallDelta, new_call_id

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
_BODY_ENDS = (END, CALL, RETURN)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*(\w+)")
# How the reply's first header may begin, right after the prompt's <|start|>assistant: its channel, or
# its recipient first (as gpt-oss's template writes calls in the history).
_HEADER_STARTS = (CHANNEL, "to=")


def _held(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of text could begin one of the tags."""
    for n in range(min(max(len(t) for t in tags) - 1, len(text)), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class HarmonyParser:
    """States: `header` (reading a message's header up to <|message|>), `body`, and `between` (after a
    body's end, before the next message's <|start|>)."""

    def __init__(self, tools: bool) -> None:
        """tools: messages addressed to functions are tool calls (else their bodies are content)."""
        self.tools = tools
        self.state = "header"
        self.pending = ""
        self.first = True  # the reply's first message, whose header may be missing
        self.channel = ""
        self.call: int | None = None  # the tool call the body feeds
        self.num_calls = 0

    def feed(self, text: str) -> tuple[Split, Delta]:
        self.pending += text
        split, delta = Split(), Delta()
        while self._step(split, delta, final=False):
            pass
        return split, delta

    def finish(self) -> tuple[Split, Delta]:
        split, delta = Split(), Delta()
        while self._step(split, delta, final=True):
            pass
        self.pending = ""  # a header cut short (max_tokens) says nothing
        return split, delta

    def _step(self, split: Split, delta: Delta, final: bool) -> bool:
        text = self.pending
        if not text:
            return False
        if self.state == "between":
            at = text.find(START)
            if at < 0:
                keep = 0 if final else _held(text, (START,))
                self.pending = text[len(text) - keep:]  # stray text between messages is dropped
                return False
            self.state, self.pending = "header", text[at + len(START):]
            return True
        if self.state == "header":  # the whole header stays pending until <|message|>
            at = text.find(MESSAGE)
            if at < 0:
                lead = text.lstrip()
                if self.first and lead and not any(h.startswith(lead) or lead.startswith(h) for h in _HEADER_STARTS):
                    self.state = "content"  # no header: the model wrote plain text
                    return True
                return False
            self._open(text[:at], delta)
            self.pending, self.state, self.first = text[at + len(MESSAGE):], "body", False
            return True
        if self.state == "content":
            delta.content += text
            self.pending = ""
            return False
        # body: up to whichever end comes first
        ends = [(text.find(t), t) for t in _BODY_ENDS if text.find(t) >= 0]
        if ends:
            at, tag = min(ends)
            self._body(text[:at], split, delta)
            self.pending, self.state, self.call = text[at + len(tag):], "between", None
            return True
        keep = 0 if final else _held(text, _BODY_ENDS)
        self._body(text[:len(text) - keep], split, delta)
        self.pending = text[len(text) - keep:]
        return False

    def _open(self, header: str, delta: Delta) -> None:
        channel = _CHANNEL.search(header)
        self.channel = channel.group(1) if channel else "final"
        recipient = _RECIPIENT.search(header)
        if recipient is not None and self.tools:
            self.call = self.num_calls
            self.num_calls += 1
            delta.calls.append(ToolCallDelta(self.call, new_call_id(), recipient.group(1)))

    def _body(self, text: str, split: Split, delta: Delta) -> None:
        if not text:
            return
        if self.call is not None:
            delta.add_args(self.call, text)
        elif self.channel == "analysis":
            split.reasoning += text
        else:
            delta.content += text
