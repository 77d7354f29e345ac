"""The tokenizer's work for the HTTP process (tokenize, render chat templates, detokenize), off the
event loop and within limits, so that one large prompt never stalls every other request's stream."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from tandem.engine.processor import check_encodable
from tandem.sampling_params import ParamError
from tandem.serve.errors import bad_request
from tandem.serve.template_sandbox import TemplateError, TemplateSandbox

T = TypeVar("T")


class TextWorker:
    """One worker thread, as vLLM keeps one: a fast tokenizer shared across threads can fail with
    "Already borrowed", and one thread already frees the event loop. A request's own chat template
    goes to the sandbox (a process) if the server trusts request templates, and is refused if not."""

    def __init__(self, tokenizer: Any, max_prompt_chars: int, sandbox: TemplateSandbox | None) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_chars = max_prompt_chars
        self.sandbox = sandbox
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenizer")

    async def start(self) -> None:
        if self.sandbox is not None:
            await self.sandbox.start()

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def check_chars(self, texts: Iterable[str], param: str) -> None:
        """Before tokenizing: the request's text, all prompts or messages together, within the limit."""
        total = sum(len(t) for t in texts)
        if total > self.max_prompt_chars:
            raise bad_request(f"the request's text is {total} characters, more than this server's limit of "
                              f"{self.max_prompt_chars} (--max-prompt-chars)", param)

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_chars([text], param)
        return await self._run(self._encode, text, add_special_tokens, param)

    async def decode(self, ids: list[int]) -> str:
        return await self._run(self.tokenizer.decode, ids)

    async def chat_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                       template: str | None = None, tools: list[dict[str, Any]] | None = None,
                       kwargs: dict[str, Any] | None = None) -> list[int]:
        """`tools`: for a template that renders them itself (tandem.serve.tool_calls.prompt); `kwargs`:
        the request's chat_template_kwargs (variables such as enable_thinking)."""
        self.check_chars((m["content"] for m in messages), "messages")
        kwargs = self._template_kwargs(kwargs)
        if template is None:  # the model's own template: trusted, rendered here
            return await self._run(self._render_and_encode, messages, add_generation_prompt, tools, kwargs)
        if self.sandbox is None:
            raise bad_request("this server does not accept a chat_template in the request "
                              "(start it with --trust-request-chat-template)", "chat_template")
        try:
            text = await self.sandbox.render(messages, template, add_generation_prompt, tools, kwargs)
        except TemplateError as e:
            raise bad_request(str(e), "chat_template") from e
        return await self._run(self._encode, text, False, "chat_template")

    async def chat_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                        tools: list[dict[str, Any]] | None = None, kwargs: dict[str, Any] | None = None) -> str:
        """The model's own template rendered, as text (a follow-up's new turn is the difference of two)."""
        self.check_chars((m["content"] for m in messages), "messages")
        return await self._run(self._render, messages, add_generation_prompt, tools, self._template_kwargs(kwargs))

    # -- on the worker thread -------------------------------------------------------------------
    def _encode(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            check_encodable(text, param)
        except ParamError as e:
            raise bad_request(str(e), param) from e
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _template_kwargs(self, kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """A request's template variables, never apply_chat_template's own arguments: one named
        chat_template would render an untrusted template here, outside the sandbox."""
        if not kwargs:
            return {}
        own = set(inspect.signature(self.tokenizer.apply_chat_template).parameters) | {"conversation", "messages"}
        taken = sorted(set(kwargs) & own)
        if taken:
            raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}: they are the renderer's own "
                              "arguments", "chat_template_kwargs")
        return kwargs

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # a template error is the request's problem (e.g. roles out of order)
            raise bad_request(f"cannot apply the chat template: {e}", "messages") from e

    def _render_and_encode(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                           tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]) -> list[int]:
        return self._encode(self._render(messages, add_generation_prompt, tools, kwargs), False, "messages")
