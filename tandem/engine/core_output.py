"""What an engine step gives each request it advanced: plain data, the same in-process and on the wire
(the API process and a cluster's router stream it without importing the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.logprobs import SampleLogprobs


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[SampleLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    # With the first output token of a request that asked: its prompt tokens' logprobs, from the second.
    prompt_logprobs: list[SampleLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
