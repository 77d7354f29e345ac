"""Responses API request bodies, and what they are in the server's own terms: template messages (for a
ChatInput) and SamplingParams."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from tandem.sampling_params import ParamError, SamplingParams, StructuredOutputs
from tandem.serve.protocol import INT32, ArgumentsText, RequestBody, Text, _finite


class ContentText(RequestBody):
    type: Literal["input_text", "output_text", "text"]
    text: Text
    annotations: list[Any] | None = None


class ContentMedia(RequestBody):
    """An image or a file: declared so that the refusal can say what is missing (a text model)."""

    type: Literal["input_image", "input_file", "input_audio"]


class MessageItem(RequestBody):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[Annotated[ContentText | ContentMedia, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if isinstance(part, ContentMedia):
                raise ParamError(f"{part.type} content is not served: this model reads text only", "input")
        return "".join(p.text for p in self.content if isinstance(p, ContentText))


class FunctionCallItem(RequestBody):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: ArgumentsText
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(RequestBody):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[ContentText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningItem(RequestBody):
    """An earlier turn's reasoning: kept out of the prompt, as the models' own templates drop it."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] | None = None
    content: list[Any] | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(RequestBody):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(RequestBody):
    type: Literal["function"]
    name: str


class TextFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(RequestBody):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(RequestBody):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(RequestBody):
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=INT32)
    temperature: float | None = _finite(None, ge=0, le=2)
    top_p: float | None = _finite(None, gt=0, le=1)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    reasoning: ReasoningConfig | None = None  # one effort here; the reasoning parser shows what there is
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # Tandem's, as in its other APIs: this request's deadline, its scheduling priority, its cache salt.
    timeout: float | None = _finite(None, gt=0)
    priority: int = Field(0, ge=-INT32, lt=INT32)
    cache_salt: Text | None = None

    @property
    def max_tokens(self) -> int | None:  # what a Call reads
        return self.max_output_tokens

    def items(self) -> list[Any]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        if not self.input:
            raise ParamError("input must not be empty", "input")
        return list(self.input)

    def system(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": self.instructions}] if self.instructions else []

    def functions(self) -> list[dict[str, Any]] | None:
        shown = {"name", "description", "parameters"}
        return [t.model_dump(exclude_none=True, include=shown) for t in self.tools] if self.tools else None

    def choice(self) -> str | dict[str, Any] | None:
        c = self.tool_choice
        if isinstance(c, NamedFunction):
            return {"name": c.name}
        return c if self.tools or c not in (None, "auto") else None

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, max_tokens=self.max_output_tokens,
                              structured=self.structured())

    def structured(self) -> StructuredOutputs | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputs("json_object")
        if fmt.schema_ is None:
            raise ParamError("text.format json_schema needs its schema", "text")
        return StructuredOutputs("json", json.dumps(fmt.schema_), strict=bool(fmt.strict))


def template_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as the chat template's messages: consecutive function calls join one assistant turn
    (after its text, if the turn has any); each call's output is a tool message."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "name": item.name, "arguments": item.arguments}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return out
