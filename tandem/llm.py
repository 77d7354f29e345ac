"""The offline API, shaped like vLLM's: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.processor import PromptType
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

Conversation = list[dict[str, Any]]
PromptInput = PromptType | dict[str, Any]


def _unpack(prompt: PromptInput) -> tuple[PromptType, str | None]:
    if not isinstance(prompt, dict):
        return prompt, None
    body = prompt.get("prompt_token_ids", prompt.get("prompt"))
    if body is None:
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return body, prompt.get("cache_salt")


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", **engine_options: Any) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, dtype=dtype, **engine_options))

    def close(self) -> None:
        """Stop what the engine started (a worker group's processes, the KV store's threads)."""
        self.engine.core.close()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts are strings, token-id lists, or dicts {"prompt" | "prompt_token_ids": ...,
        "cache_salt": ...} as in vLLM (the salt keeps a tenant's prefix-cache blocks its own)."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        items = [_unpack(p) for p in prompts]  # type: ignore[union-attr]
        return self._run([p for p, _ in items], sampling_params, [None] * len(items), use_tqdm,
                         [s for _, s in items])

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.apply_chat_template(c, add_generation_prompt, chat_template)  # type: ignore[arg-type]
                   for c in conversations]
        texts = [self.engine.tokenizer.decode(p) for p in prompts]
        return self._run(prompts, sampling_params, texts, use_tqdm)

    def _run(self, prompts: list[PromptType], sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             texts: list[str | None], use_tqdm: bool, salts: list[str | None] | None = None) -> list[RequestOutput]:
        salts = salts or [None] * len(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) \
            else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        engine = self.engine
        ids = []
        try:
            for prompt, p, text, salt in zip(prompts, params, texts, salts, strict=True):
                rid = engine.next_request_id()
                engine.add_request(rid, prompt, p, cache_salt=salt, prompt_text=text)
                ids.append(rid)
        except ValueError:
            for rid in ids:  # a bad prompt rejects the whole call and leaves nothing queued
                engine.abort_request(rid)
            raise
        finished: dict[str, RequestOutput] = {}
        columns = (TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[tps]:.0f} tok/s out"))
        with Progress(*columns, disable=not (use_tqdm and sys.stderr.isatty()), transient=True) as progress:
            task = progress.add_task("", total=len(ids), tps=0.0)
            num_out = 0
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_out += sum(len(c.token_ids) for c in out.outputs)
                        progress.update(task, completed=len(finished),
                                        tps=num_out / max(progress.tasks[0].elapsed or 1e-9, 1e-9))
        return [finished[rid] for rid in ids]
