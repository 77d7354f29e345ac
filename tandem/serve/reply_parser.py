"""A streamed reply's text as its reasoning, its content and its tool calls: the reasoning split
first (`--reasoning-parser`), then the tool-call parser over what is not reasoning. One composition
for every API that streams (chat completions, Messages, Responses), so they agree on each piece."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.serve.reasoning import ReasoningFormat, ReasoningParser
from tandem.serve.tool_calls.formats import ToolFormat
from tandem.serve.tool_calls.parser import Delta, ToolCallParser


@dataclass
class ReplyPiece:
    reasoning: str  # reasoning text in this piece ("" without a reasoning format)
    delta: Delta  # its content and tool-call pieces (all content without a tool format)


class ReplyParser:
    def __init__(self, tools: ToolFormat | None, reasoning: ReasoningFormat | None,
                 reasoning_opened: bool = False) -> None:
        """reasoning_opened: the prompt ended inside the reasoning (its template opened it)."""
        self.thinking = ReasoningParser(reasoning, reasoning_opened) if reasoning is not None else None
        self.tools = ToolCallParser(tools) if tools is not None else None

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> ReplyPiece:
        """The next text delta; final: the reply ends with it (what a parser held back comes out)."""
        reasoning = ""
        if self.thinking is not None:
            split = self.thinking.feed(text)
            if final:
                split.extend(self.thinking.finish())
            reasoning, text = split.reasoning, split.content
        if self.tools is None:
            return ReplyPiece(reasoning, Delta(text))
        delta = self.tools.feed(text)
        if final:
            delta.extend(self.tools.finish())
        return ReplyPiece(reasoning, delta)
