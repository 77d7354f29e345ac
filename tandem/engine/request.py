"""A request as the engine core sees it: token ids, progress, status and timings."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.logprobs import SampleLogprobs
from tandem.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Blocks allocated, KV arriving through the KV connector (a store, a prefill worker).
    WAITING_FOR_KV = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    # A step failed because of this request (found by retrying the step without it).
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def completed(self) -> bool:
        """Finished normally: stopped or reached its length (not aborted, not failed)."""
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                   RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # The request as it arrived, named and meant as EngineCoreRequest's fields (core_request.py).
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    tenant: str | None = None
    tenant_weight: float = 1.0
    retain_kv_as: str | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prefix-cache hashes of the request's full blocks, extended as tokens are appended.
    block_hashes: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hit on first admission
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Draft tokens proposed for the next step (speculative decoding); not yet part of the output.
    spec_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs by the position of the token they score (1..prompt length - 1), filled chunk
    # by chunk, sent once with the first output token.
    prompt_logprobs: dict[int, SampleLogprobs] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False

    scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @classmethod
    def from_core_request(cls, r: EngineCoreRequest) -> Request:
        """The engine's own request, made on arrival from what crossed the process boundary."""
        request = cls(r.request_id, list(r.prompt_token_ids), r.sampling_params, r.eos_token_ids, r.cache_salt,
                      r.arrival_time, r.priority, r.tenant, r.tenant_weight, r.retain_kv_as)
        for token in r.output_token_ids:
            request.append_output_token(token)
        return request

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Its prompt's logprobs are still to compute (so no prefix-cache hit may skip a token). One
        that arrives with output (a decode worker's) had its prompt scored where it was prefilled."""
        return self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs_sent \
            and not self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """Whether the output token just appended ends the request, and how: an end token of the model
        or a stop token (not before min_tokens), max_tokens, or the context's end."""
        params = self.sampling_params
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
