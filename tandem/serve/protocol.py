"""OpenAI-compatible request bodies (with vLLM's extra sampling fields) and error bodies."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from tandem.engine.processor import check_encodable
from tandem.sampling_params import MAX_SEED, ParamError, SamplingParams, StructuredOutputs

INT32 = 2**31
# A logit_bias key: a token id in ASCII decimal, nothing else (no sign, spaces, underscores or other scripts' digits).
_TOKEN_ID_KEY = re.compile(r"[0-9]+")
# Strict: JSON true and 1.0 are not token ids. The vocabulary bound is the engine's (InputProcessor).
TokenId = Annotated[StrictInt, Field(ge=0, lt=INT32)]


def _encodable(value: Any, info: ValidationInfo) -> Any:
    for item in value if isinstance(value, list) else [value]:
        text = item.text if isinstance(item, ContentPart) else item
        if isinstance(text, str):
            check_encodable(text, info.field_name)
    return value


# Every string that reaches the tokenizer, a template or an error message must have a UTF-8 form.
# The check goes after a union (not inside it), so that an error's location is the field's name.
Text = Annotated[str, AfterValidator(_encodable)]
Texts = Annotated[str | list[str], AfterValidator(_encodable)]


def _json_object_text(v: str) -> str:
    try:
        ok = isinstance(json.loads(v), dict)
    except json.JSONDecodeError:
        ok = False
    if not ok:
        raise ValueError("a tool call's arguments must be a JSON object (as text)")
    return v


# A tool call's arguments as a client sends back what the API returned: a JSON object's text.
ArgumentsText = Annotated[Text, AfterValidator(_json_object_text)]


class RequestBody(BaseModel):
    """A JSON object of a request. Fields no model declares are accepted, as vLLM accepts them, and
    kept only so that unknown_fields can name them: nothing else reads them."""

    model_config = ConfigDict(extra="allow")


def unknown_fields(body: BaseModel, prefix: str = "") -> list[str]:
    """The fields a request sent that no model declares, each once, as its path in the schema:
    `stream_options.x`; a list's items share one path (`messages[].x`), so a long chat names a
    field once. Free-form objects (a schema, logit_bias) have no unknown fields."""
    found = [prefix + name for name in body.model_extra or {}]
    for name, field in type(body).model_fields.items():
        found += _unknown_in(getattr(body, name), prefix + (field.alias or name))
    return list(dict.fromkeys(found))


def _unknown_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, path + ".")
    if isinstance(value, list):
        return [name for item in value for name in _unknown_in(item, path + "[]")]
    return []


def _finite(default: float | None, **bounds: float) -> Any:
    # JSON bodies may carry NaN and Infinity (Python's json reads them); no sampling knob means anything then.
    return Field(default, allow_inf_nan=False, **bounds)


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _constraint(kind: str, value: Any) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return StructuredOutputs("choice", json.dumps(value))
    return StructuredOutputs(kind, "" if value is True else value)


class JsonSchemaFormat(RequestBody):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(RequestBody):
    """vLLM's `structured_outputs` request field: at most one constraint of these, and its options for
    whichever JSON constraint the request gives (here or in response_format / guided_json)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's names. Whitespace: false is llguidance's flexible default; unset, the server's
    # (--structured-outputs-whitespace, compact unless told).
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool = False  # as strict: objects take only the properties they name

    def constraints(self) -> list[StructuredOutputs]:
        return [_constraint(kind, value) for kind, value in (
            ("json", self.json_), ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar),
            ("json_object", self.json_object or None)) if value is not None]

    def options(self, constraint: StructuredOutputs) -> StructuredOutputs:
        """A JSON constraint (from here or another field) with this field's whitespace and strictness."""
        if constraint.kind not in ("json", "json_object"):
            return constraint
        whitespace = constraint.whitespace_flexible if self.disable_any_whitespace is None \
            else not self.disable_any_whitespace
        return replace(constraint, strict=constraint.strict or self.disable_additional_properties,
                       whitespace_flexible=whitespace)

    def constraint(self) -> StructuredOutputs | None:
        """The one constraint this field names (ParamError when it names several)."""
        found = self.constraints()
        if len(found) > 1:
            raise ParamError(f"give one output constraint, not {len(found)}", "structured_outputs")
        return self.options(found[0]) if found else None


class _SamplingFields(RequestBody):
    """Fields shared by completions and chat completions."""

    model: Text | None = None
    user: str | None = None  # OpenAI's end-user id: declared, as vLLM declares it, so not unknown; unused
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = _finite(None, ge=0, le=2)
    top_p: float | None = _finite(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, lt=INT32)  # -1 and 0 disable it; the vocabulary bounds it
    min_p: float | None = _finite(None, ge=0, le=1)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    presence_penalty: float = _finite(0.0, ge=-2, le=2)
    frequency_penalty: float = _finite(0.0, ge=-2, le=2)
    repetition_penalty: float = _finite(1.0, gt=0)
    stop: Texts | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, lt=INT32)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Text | None = None
    # vLLM's meaning: a lower value is scheduled first. Validated here; the scheduler honours it.
    priority: int = Field(0, ge=-INT32, lt=INT32)
    timeout: float | None = _finite(None, gt=0)  # seconds for this request (at most --request-timeout)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # OpenAI's: token ids (as JSON object keys, so strings) to a bias in [-100, 100] (SamplingParams checks it).
    logit_bias: dict[str, float] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_shape(cls, v: Any) -> Any:
        # Before pydantic's coercion: it (and int()) would take "1_0", " 12 ", "١٢" as token ids and
        # true or "5" as biases, so a malformed map would bias some token instead of being a 400.
        for token, bias in v.items() if isinstance(v, dict) else ():
            if not isinstance(token, str) or not _TOKEN_ID_KEY.fullmatch(token):
                raise ValueError(f"logit_bias keys must be token ids written as ASCII digits (got {token!r})")
            if isinstance(bias, bool) or not isinstance(bias, int | float):
                raise ValueError(f"logit_bias values must be numbers (got {bias!r} for token {token})")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_non_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        if len(items) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            seed=self.seed, presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, max_tokens=max_tokens, min_tokens=self.min_tokens,
            stop=self.stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens, structured=self.structured(),
            logit_bias=self.token_biases())

    def token_biases(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        biases = {}
        for token, bias in self.logit_bias.items():
            try:
                biases[int(token)] = bias
            except ValueError:  # ASCII digits (checked on parsing), but too many for int()
                raise ParamError(f"logit_bias keys must be token ids (got {token!r})", "logit_bias") from None
        return biases

    def structured(self) -> StructuredOutputs | None:
        """The one output constraint the request names (ParamError when it names several)."""
        found: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputs("json_object")))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ParamError("response_format json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", StructuredOutputs("json", json.dumps(rf.json_schema.schema_),
                                                               strict=bool(rf.json_schema.strict))))
        so = self.structured_outputs
        if so is not None:
            found += [("structured_outputs", c) for c in so.constraints()]
        for kind, value in (("json", self.guided_json), ("regex", self.guided_regex), ("choice", self.guided_choice),
                            ("grammar", self.guided_grammar)):
            if value is not None:
                found.append((f"guided_{kind}", _constraint(kind, value)))
        if len(found) > 1:
            raise ParamError(f"give one output constraint, not {len(found)} ({', '.join(f for f, _ in found)})",
                             found[1][0])
        if not found:
            return None
        constraint = found[0][1]
        return constraint if so is None else so.options(constraint)


class CompletionRequest(_SamplingFields):
    prompt: Annotated[str | list[str] | list[TokenId] | list[list[TokenId]], AfterValidator(_encodable)]
    max_tokens: int | None = Field(16, ge=1, lt=INT32)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, v: Any, handler: Any) -> Any:
        # The union's own error lists one failure per member; one sentence says more.
        try:
            v = handler(v)
        except ValidationError as e:
            encoding = [err["msg"] for err in e.errors() if "UTF-8" in err["msg"]]
            if encoding:
                raise ValueError(encoding[0].removeprefix("Value error, ")) from None
            raise ValueError("prompt must be a string, a list of strings, a list of token ids (integers in "
                             f"[0, {INT32})), or a list of such lists") from None
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ContentPart(RequestBody):
    type: Literal["text"]
    text: str  # checked by the message's content validator, which names the field


class FunctionDef(RequestBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; none: any object
    strict: bool | None = None  # every call is held to the schema when it is forced (tool_choice)


class Tool(RequestBody):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(RequestBody):
    name: str


class NamedToolChoice(RequestBody):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(RequestBody):
    name: Text
    arguments: ArgumentsText


class MessageToolCall(RequestBody):
    id: Text
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(RequestBody):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Annotated[str | list[ContentPart], AfterValidator(_encodable)] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: Text | None = None  # a tool result: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, lt=INT32)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    chat_template: Text | None = None  # refused unless the server runs with --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None  # the template's variables, e.g. {"enable_thinking": false}
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def function_defs(self) -> list[dict[str, Any]] | None:
        # What the template shows: the declared fields only (not strict, nor a field no model declares).
        shown = set(FunctionDef.model_fields) - {"strict"}
        return [t.function.model_dump(exclude_none=True, include=shown) for t in self.tools] if self.tools \
            else None

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        c = self.tool_choice
        return {"name": c.function.name} if isinstance(c, NamedToolChoice) else c


class TokenizeRequest(RequestBody):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(RequestBody):
    model: Text | None = None
    tokens: list[TokenId]
