"""A streamed reply's text as its reasoning, its content and its tool calls: the reasoning split
first (`--reasoning-parser`), then the tool-call parser over what is not reasoning; or, for gpt-oss's
harmony format (either parser named for it), one parser for all three. One composition for every API
that streams (chat completions, Messages, Responses), so they agree on each piece."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.serve.harmony import HarmonyParser
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
        self.harmony = HarmonyParser(tools is not None) if uses_harmony(tools, reasoning) else None
        self.thinking = ReasoningParser(reasoning, reasoning_opened) if reasoning is not None else None
        self.tools = ToolCallParser(tools) if tools is not None else None

    @property
    def num_calls(self) -> int:
        if self.harmony is not None:
            return self.harmony.num_calls
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> ReplyPiece:
        """The next text delta; final: the reply ends with it (what a parser held back comes out)."""
        if self.harmony is not None:
            split, delta = self.harmony.feed(text)
            if final:
                more_split, more_delta = self.harmony.finish()
                split.extend(more_split)
                delta.extend(more_delta)
            return ReplyPiece(split.reasoning, delta)
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


def uses_harmony(tools: ToolFormat | None, reasoning: ReasoningFormat | None) -> bool:
    """Whether replies are gpt-oss's harmony messages, read with their special tokens."""
    return (tools is not None and tools.harmony) or (reasoning is not None and reasoning.harmony)
