"""Anthropic Messages request bodies, and what they are in the server's own terms: a ChatInput for the
chat template and SamplingParams for the engine."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from tandem.sampling_params import ParamError, SamplingParams, StructuredOutputs
from tandem.serve.prepare import ChatInput
from tandem.serve.protocol import INT32, RequestBody, StructuredOutputsField, Text, _finite


class TextBlock(RequestBody):
    type: Literal["text"]
    text: Text
    cache_control: dict[str, Any] | None = None  # every prefix is cached here; accepted, not needed
    citations: list[dict[str, Any]] | None = None


class MediaBlock(RequestBody):
    """An image or a document: declared so that the refusal can say what is missing (a text model)."""

    type: Literal["image", "document"]
    source: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(RequestBody):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(RequestBody):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock | MediaBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(_text_only(b, "tool_result content") for b in self.content)


class ThinkingBlock(RequestBody):
    """An earlier turn's thinking: kept out of the prompt, as the models' own templates drop it."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = Annotated[TextBlock | MediaBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                  Field(discriminator="type")]


class InputMessage(RequestBody):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class ToolDef(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Text | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search and the like) are not served
    cache_control: dict[str, Any] | None = None


class ToolChoice(RequestBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(RequestBody):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = Field(None, ge=1)  # not enforced: the reasoning runs within max_tokens
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(RequestBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestBody):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # one effort here
    format: OutputFormat | None = None  # the reply is a JSON value of this schema (structured outputs)


class Metadata(RequestBody):
    user_id: str | None = None


class CountTokensRequest(RequestBody):
    model: Text
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def chat_input(self) -> ChatInput:
        messages = [{"role": "system", "content": _system_text(self.system)}] if self.system else []
        for i, m in enumerate(self.messages):
            messages += _template_messages(m, f"messages[{i}]")
        functions = [{"name": t.name, "description": t.description, "parameters": t.input_schema}
                     if t.description else {"name": t.name, "parameters": t.input_schema} for t in self.tools or []]
        choice, parallel = _tool_choice(self.tool_choice)
        # Thinking on or off is the template's enable_thinking (Qwen3's and others'); adaptive: its default.
        kwargs = {"enable_thinking": self.thinking.type != "disabled"} \
            if self.thinking is not None and self.thinking.type != "adaptive" else None
        return ChatInput(messages, functions or None, choice if functions or choice != "auto" else None, parallel,
                         template_kwargs=kwargs)


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, lt=INT32)
    stop_sequences: list[Text] | None = None
    temperature: float | None = _finite(None, ge=0, le=1)
    top_p: float | None = _finite(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=INT32)
    stream: bool = False
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # Accepted, with nothing to do here: one tier and speed, and every prefix is cached without asking.
    service_tier: str | None = None
    speed: str | None = None
    cache_control: dict[str, Any] | None = None
    # Tandem's, as in its OpenAI API: this request's deadline, its scheduling priority, its cache salt,
    # and vLLM's structured_outputs (a JSON schema, regex, choice or grammar the reply must match).
    timeout: float | None = _finite(None, gt=0)
    priority: int = Field(0, ge=-INT32, lt=INT32)
    cache_salt: Text | None = None
    structured_outputs: StructuredOutputsField | None = None

    def sampling_params(self) -> SamplingParams:
        if self.stop_sequences is not None and any(not s for s in self.stop_sequences):
            raise ParamError("stop_sequences must be non-empty strings", "stop_sequences")
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
                              max_tokens=self.max_tokens, stop=list(self.stop_sequences or []),
                              structured=self.structured())

    def structured(self) -> StructuredOutputs | None:
        """Anthropic's output_config.format (a JSON schema), or vLLM's structured_outputs: one of them."""
        schema = self.output_config.format if self.output_config is not None else None
        if schema is not None and self.structured_outputs is not None:
            raise ParamError("give output_config.format or structured_outputs, not both", "output_config")
        if schema is not None:
            return StructuredOutputs("json", json.dumps(schema.schema_))
        return self.structured_outputs.constraint() if self.structured_outputs is not None else None


def _text_only(block: Any, where: str) -> str:
    if isinstance(block, MediaBlock):
        raise ParamError(f"{where}: {block.type} blocks are not served: this model reads text only", "messages")
    return block.text


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    return "".join(b.text for b in system)


def _template_messages(m: InputMessage, where: str) -> list[dict[str, Any]]:
    """One Messages turn as the chat template's messages: a user turn's tool results become tool messages
    (in order, with the text between them as user messages); an assistant's tool_use blocks its tool_calls."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush_text() -> None:
        if text and m.role == "user":
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for block in m.content:
        if isinstance(block, ThinkingBlock):
            continue
        if isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise ParamError(f"{where}: tool_result blocks belong in user turns", "messages")
            flush_text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": ("Error: " if block.is_error else "") + block.text()})
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise ParamError(f"{where}: tool_use blocks belong in assistant turns", "messages")
            calls.append({"id": block.id, "name": block.name, "arguments": json.dumps(block.input)})
        else:
            text.append(_text_only(block, where))
    if m.role == "user":
        flush_text()
        return out or [{"role": "user", "content": ""}]
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _tool_choice(choice: ToolChoice | None) -> tuple[str | dict[str, Any], bool]:
    """Anthropic's tool_choice as the chat path's (none, auto, required, or a function's name) and
    whether several calls may be made at once."""
    if choice is None:
        return "auto", True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if not choice.name:
            raise ParamError("tool_choice of type tool needs the tool's name", "tool_choice")
        return {"name": choice.name}, parallel
    return {"any": "required"}.get(choice.type, choice.type), parallel


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorInfo


# Documented on the Messages routes in place of the OpenAI shape (serve/errors.py answers in this one there).
ANTHROPIC_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": AnthropicError, "description": "The request's error (Anthropic-shaped)"},
    "5XX": {"model": AnthropicError, "description": "The server's error (Anthropic-shaped)"},
}
