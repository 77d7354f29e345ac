"""A request made ready for the engine, or refused with a 4xx: the model name, the prompt's tokens,
its SamplingParams, the structured-output constraint and the tool plan, each checked before it is queued."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from typing import Any, Protocol

from tandem.disagg.router.engine_client import EngineClient
from tandem.engine.grammars import Grammars
from tandem.sampling_params import ParamError, SamplingParams, StructuredOutputs
from tandem.serve.app_state import Live, TextSide
from tandem.serve.calls import Admission, Call
from tandem.serve.errors import APIError, bad_request
from tandem.serve.protocol import ChatCompletionRequest, CompletionRequest
from tandem.serve.reply_parser import uses_harmony
from tandem.serve.text_worker import TextWorker
from tandem.serve.tool_calls.formats import template_knows_tools
from tandem.serve.tool_calls.plan import ToolPlan, plan_tools
from tandem.serve.tool_calls.prompt import template_inputs


def check_model(name: str | None, live: Live) -> None:
    if name is not None and name not in (live.model, live.model_path):
        raise APIError(404, f"The model `{name}` does not exist.", "NotFoundError", "model")


def need_text(text: TextSide) -> TextWorker:
    if text.worker is None:
        raise bad_request("this model has no tokenizer: send token ids", "prompt")
    return text.worker


async def tokenize(text: TextSide, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        return await need_text(text).encode(prompt)
    return list(prompt)


async def chat_ids(text: TextSide, worker: TextWorker, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None, add_generation_prompt: bool, template: str | None,
                   kwargs: dict[str, Any] | None = None) -> list[int]:
    native = template_knows_tools(template or text.template)
    msgs, native_tools = template_inputs(messages, tools, text.tool_format, native)
    return await worker.chat_ids(msgs, add_generation_prompt, template, native_tools, kwargs)


async def continued_ids(text: TextSide, worker: TextWorker, chat: ChatInput,
                        tools: list[dict[str, Any]] | None) -> list[int] | None:
    """The stored conversation's token ids, then only the new turn's: what the template renders past
    the stored messages (after the reply's end token), tokenized alone. The history is not rendered
    again into other tokens (a template that drops earlier reasoning would change them), so the prefix
    cache holds all of it. None where the template's text for the new messages does not extend its
    text for the stored ones: the caller renders the whole conversation."""
    cont = chat.continues
    assert cont is not None and chat.chat_template is None
    end = text.tokenizer.decode([cont.token_ids[-1]]) if cont.token_ids else ""
    if end not in getattr(text.tokenizer, "all_special_tokens", ()):
        return None
    native = template_knows_tools(text.template)
    before, native_tools = template_inputs(cont.messages, tools, text.tool_format, native)
    after, _ = template_inputs(chat.messages, tools, text.tool_format, native)
    stored = await worker.chat_text(before, False, native_tools, chat.template_kwargs)
    whole = await worker.chat_text(after, chat.add_generation_prompt, native_tools, chat.template_kwargs)
    if not whole.startswith(stored) or end not in stored:
        return None
    tail = stored[stored.rindex(end) + len(end):]  # what the template writes after the reply's end token
    return cont.token_ids + await worker.encode(tail + whole[len(stored):], add_special_tokens=False, param="input")


def reasoning_opened(text: TextSide, ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside the reply's reasoning (its template wrote the start tag)."""
    if text.reasoning is None or text.tokenizer is None:
        return False
    return text.tokenizer.decode(ids[-8:]).rstrip().endswith(text.reasoning.start)


def validate(engine: EngineClient, ids: list[int], params: SamplingParams, param: str) -> None:
    assert engine.inputs is not None
    try:
        engine.inputs.validate(ids, params)
    except ValueError as e:  # a ParamError names its field; the others are about the prompt
        raise bad_request(str(e), getattr(e, "param", None) or param) from e


def make_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
                logprobs: int | None) -> SamplingParams:
    try:
        return body.sampling_params(max_tokens, logprobs)
    except ValueError as e:
        raise bad_request(str(e), getattr(e, "param", None)) from e


class GrammarCheck:
    """A grammar that cannot be compiled is the client's error (400), found before it is queued.
    The compiler is built on first use (it needs the engine's vocabulary size). A JSON constraint
    whose request did not say how to space it is given the server's whitespace here."""

    def __init__(self, tokenizer: Any | None, engine: EngineClient, whitespace_flexible: bool = False) -> None:
        self.tokenizer, self.engine, self.whitespace_flexible = tokenizer, engine, whitespace_flexible
        self._grammars: Grammars | None = None

    async def check(self, params: SamplingParams, param: str = "response_format") -> None:
        if params.structured is None:
            return
        if params.structured.whitespace_flexible is None:
            params.structured = replace(params.structured, whitespace_flexible=self.whitespace_flexible)
        if self.tokenizer is None:
            raise bad_request("structured outputs need the model's tokenizer", param)
        if self._grammars is None:
            assert self.engine.info is not None
            self._grammars = Grammars(self.tokenizer, self.engine.info.vocab_size)
        error = await asyncio.to_thread(self._grammars.check, params.structured)
        if error:
            raise bad_request(f"invalid {params.structured.kind} constraint: {error.strip()}", param)


@dataclass(frozen=True)
class Continuation:
    """A stored conversation a request continues: its messages as rendered (the reply included) and
    its token ids, up to the reply's end token."""

    messages: list[dict[str, Any]]
    token_ids: list[int]


@dataclass(frozen=True)
class ChatInput:
    """A chat request as every chat API (OpenAI's chat, Anthropic's Messages) gives it to the template:
    its messages as template dicts (role, content, tool_calls, tool_call_id), the function definitions
    (name, description, parameters), and tool_choice as none, auto, required or {"name": ...}."""

    messages: list[dict[str, Any]]
    functions: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    template_kwargs: dict[str, Any] | None = None  # chat_template_kwargs: variables such as enable_thinking
    continues: Continuation | None = None  # the messages start with this stored conversation's
    tools_param: str = "tools"  # the field a bad tool definition or choice is blamed on


class ChatAPI(Protocol):
    """What preparing a chat request reaches: the engine, the text side, the grammar check and admission."""

    engine: EngineClient
    text: TextSide
    grammars: GrammarCheck
    admission: Admission


async def chat_prompt(s: ChatAPI, chat: ChatInput, params: SamplingParams,
                      call: Call) -> tuple[list[int], ToolPlan | None]:
    """A chat request's prompt ids and tool plan, each step checked before the next costs more: the tools
    and the grammar they force, admission before rendering, the rendered prompt against the context,
    then admission again with the prompt's uncached tokens. Unset max_tokens runs to the context's end."""
    if s.text.worker is None:
        raise bad_request("this model has no tokenizer, so it has no chat template")
    tools = tool_plan(s.text, chat, params)
    await s.grammars.check(params, chat.tools_param if tools is not None and tools.grammar else "response_format")
    s.admission.admit(call, 1, params)
    prompt_tools = tools.prompt_tools if tools else None
    ids = await continued_ids(s.text, s.text.worker, chat, prompt_tools) if chat.continues else None
    if ids is None:
        ids = await chat_ids(s.text, s.text.worker, chat.messages, prompt_tools, chat.add_generation_prompt,
                             chat.chat_template, chat.template_kwargs)
    if params.max_tokens is None:
        assert s.engine.info is not None
        params.max_tokens = max(s.engine.info.max_model_len - len(ids), 1)
    if uses_harmony(s.text.tool_format, s.text.reasoning):
        params.skip_special_tokens = False  # the harmony parser reads the channels' special tokens
    validate(s.engine, ids, params, "messages")
    s.admission.admit(call, 1, params, [ids])
    return ids, tools


def tool_plan(text: TextSide, chat: ChatInput, params: SamplingParams) -> ToolPlan | None:
    """The request's tools; a forced call (required, a named function) becomes its grammar."""
    try:
        plan = plan_tools(text.tool_format, chat.functions, chat.tool_choice, chat.parallel_tool_calls)
    except ParamError as e:
        raise bad_request(str(e), e.param) from e
    if plan is not None and plan.grammar is not None:
        if params.structured is not None:
            raise bad_request("tool_choice required or a named function cannot be combined with another "
                              "output constraint", "tool_choice")
        params.structured = StructuredOutputs("grammar", plan.grammar)
    return plan
