"""A reply's reasoning apart from its answer (`--reasoning-parser`), incrementally: fed each streamed
text delta, it says which part is reasoning and which is content, holding back only what could still
be part of a tag. A whole reply is parsed by feeding it at once, so a response and its stream agree.

Formats, as vLLM names them:
- `qwen3`: reasoning is what a `<think>` ... `</think>` pair at the reply's start holds; a reply that
  opens with anything else is all content (thinking off). A prompt whose template already opened the
  pair (`<think>` at its end) starts the reply inside it.
- `deepseek_r1`: the reply starts inside its reasoning (its templates open `<think>`, and the model
  may write it again), which runs up to `</think>`; a reply cut short before it is all reasoning.
- `openai_gptoss`: gpt-oss's harmony channels, the analysis channel being the reasoning; its own
  parser (tandem/serve/harmony.py) reads tool calls from the same messages.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str
    end: str
    starts_inside: bool  # the reply begins in its reasoning even without the start tag
    harmony: bool = False  # gpt-oss's channels (tandem/serve/harmony.py), not a pair of tags


QWEN3 = ReasoningFormat("qwen3", "<think>", "</think>", starts_inside=False)
DEEPSEEK_R1 = ReasoningFormat("deepseek_r1", "<think>", "</think>", starts_inside=True)
OPENAI_GPTOSS = ReasoningFormat("openai_gptoss", "<|channel|>analysis<|message|>", "<|end|>", starts_inside=False,
                                harmony=True)
REASONING_FORMATS = {f.name: f for f in (QWEN3, DEEPSEEK_R1, OPENAI_GPTOSS)}


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""

    def extend(self, other: Split) -> None:
        self.reasoning += other.reasoning
        self.content += other.content


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (kept back until the next delta)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningParser:
    """States: `opening` (the reply's leading whitespace and maybe its start tag), `reasoning`,
    `answer_start` (whitespace right after the end tag, dropped) and `content`."""

    def __init__(self, fmt: ReasoningFormat, prompt_opened: bool = False) -> None:
        """prompt_opened: the rendered prompt ends with the start tag (the template began the reasoning)."""
        self.fmt = fmt
        self.state = "reasoning" if prompt_opened else "opening"
        self.pending = ""

    def feed(self, text: str) -> Split:
        self.pending += text
        out = Split()
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> Split:
        out = Split()
        while self._step(out, final=True):
            pass
        if self.pending:  # a tag cut short is text of the part it was in
            if self.state == "reasoning":
                out.reasoning += self.pending
            else:
                out.content += self.pending
            self.pending = ""
        return out

    def _step(self, out: Split, final: bool) -> bool:
        """One move on the pending text; False when it must wait for more (or is empty)."""
        fmt, text = self.fmt, self.pending
        if not text:
            return False
        if self.state == "opening":
            stripped = text.lstrip()
            if stripped.startswith(fmt.start):
                self.state, self.pending = "reasoning", stripped[len(fmt.start):]
                return True
            if not final and fmt.start.startswith(stripped):  # whitespace, or the tag's first characters
                return False
            self.state = "reasoning" if fmt.starts_inside else "content"
            return True
        if self.state == "reasoning":
            at = text.find(fmt.end)
            if at >= 0:
                out.reasoning += text[:at]
                self.state, self.pending = "answer_start", text[at + len(fmt.end):]
                return True
            keep = 0 if final else _held(text, fmt.end)
            out.reasoning += text[:len(text) - keep]
            self.pending = text[len(text) - keep:]
            return False
        if self.state == "answer_start":
            stripped = text.lstrip()
            if not stripped:
                self.pending = ""
                return False
            self.state, self.pending = "content", stripped
            return True
        out.content += text
        self.pending = ""
        return False


def split_reply(fmt: ReasoningFormat, text: str, prompt_opened: bool = False) -> Split:
    parser = ReasoningParser(fmt, prompt_opened)
    out = parser.feed(text)
    out.extend(parser.finish())
    return out
