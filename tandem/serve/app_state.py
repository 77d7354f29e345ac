"""The state the route groups share, typed: what exists once the engine has started (Live, left in
Started by the app's lifespan) and the text side (the tokenizer, its worker, the chat template and
the tool-call format). Each group is handed only the pieces it names (its own dataclass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.serve.metrics import ServerMetrics
from tandem.serve.reasoning import REASONING_FORMATS, ReasoningFormat
from tandem.serve.settings import ServerSettings
from tandem.serve.template_sandbox import TemplateSandbox
from tandem.serve.text_worker import TextWorker
from tandem.serve.tool_calls.formats import ToolFormat, format_for


@dataclass(frozen=True)
class Live:
    """What exists once the engine has started: the served model's names, the server's metrics and
    when it started."""

    model: str  # the name it is served as (--served-model-name, else the engine's)
    model_path: str  # the model as configured: a request may name it too
    metrics: ServerMetrics
    started_at: float


class Started:
    """Where the lifespan leaves the Live state; the routes read it (they run only after start-up)."""

    def __init__(self) -> None:
        self._live: Live | None = None

    def set(self, live: Live) -> None:
        self._live = live

    @property
    def live(self) -> Live:
        if self._live is None:
            raise RuntimeError("the server has not started")
        return self._live


@dataclass(frozen=True)
class TextSide:
    """The tokenizer and what is made of it; tokenizer and worker are None for a model served by token ids."""

    tokenizer: Any | None
    worker: TextWorker | None  # encodes, decodes and renders chat templates off the event loop
    template: str | None  # the model's chat template
    tool_format: ToolFormat  # how the model's replies write tool calls
    reasoning: ReasoningFormat | None = None  # how they set their reasoning apart (--reasoning-parser)

    @classmethod
    def build(cls, tokenizer: Any | None, settings: ServerSettings) -> TextSide:
        worker: TextWorker | None = None
        if tokenizer is not None:
            sandbox = TemplateSandbox(tokenizer.special_tokens_map, settings.chat_template_timeout,
                                      settings.max_prompt_chars) if settings.trust_request_chat_template else None
            worker = TextWorker(tokenizer, settings.max_prompt_chars, sandbox)
        template = getattr(tokenizer, "chat_template", None)
        reasoning = REASONING_FORMATS[settings.reasoning_parser] if settings.reasoning_parser else None
        return cls(tokenizer, worker, template, format_for(template, settings.tool_call_parser), reasoning)
