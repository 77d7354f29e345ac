"""LLMEngine: the frontend halves around an in-process EngineCore (the offline path)."""

from __future__ import annotations

import itertools
from typing import Any

from tandem.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.processor import InputProcessor, ModelLimits, OutputProcessor, PromptType
from tandem.engine.request import Request
from tandem.engine.worker_group import load_engine_model
from tandem.model.loader import LoadedModel
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams


def model_limits(config: EngineConfig, loaded: LoadedModel, max_model_len: int) -> ModelLimits:
    return ModelLimits(max_model_len, loaded.arch.vocab_size, loaded.end_token_ids,
                       config.scheduler.max_num_batched_tokens, config.scheduler.enable_chunked_prefill)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.loaded = load_engine_model(config)
        self.core = EngineCore(config, self.loaded.model, tokenizer=lambda: self.loaded.tokenizer)
        self.tokenizer: Any | None = self.loaded.tokenizer
        self.inputs = InputProcessor(self.tokenizer, model_limits(config, self.loaded, self.core.max_model_len))
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    cache_salt: str | None = None, prompt_text: str | None = None,
                    arrival_time: float | None = None) -> None:
        """Validate and enqueue; raises ValueError on bad input, leaving the engine untouched."""
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.inputs.tokenize(prompt)
        requests = self.inputs.make_requests(request_id, ids, params, cache_salt, arrival_time)
        self.outputs.add(request_id, prompt_text if prompt_text is not None else text, requests)
        for r in requests:
            self.core.add_request(Request.from_core_request(r))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        children = self.outputs.child_ids(request_id)
        self.core.abort(children)
        return self.outputs.abort(request_id)

    def step(self) -> list[RequestOutput]:
        results, stopped = self.outputs.process(self.core.step())
        self.core.abort(stopped)
        return results

    def has_unfinished_requests(self) -> bool:
        return self.outputs.has_unfinished()

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            chat_template: str | None = None) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if not messages:
            raise ValueError("messages must not be empty")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template)
        # The template already spells out the special tokens (BOS, role markers).
        return self.tokenizer.encode(text, add_special_tokens=False)
