"""A request in flight through the router: its phase, the workers it is on, what the router
predicted for it and what it measured."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from tandem.disagg.router.registry import WorkerHandle
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_request import EngineCoreRequest


class Phase(enum.Enum):
    ROUTING = "routing"  # choosing a path and workers
    RESERVE = "reserve"  # a decode worker allocates blocks for the prompt
    PREFILL = "prefill"  # a prefill worker computes the prompt and ships its KV
    DECODE = "decode"  # the decode worker streams the rest
    WHOLE = "whole"  # one worker runs all of it (colocated, prefill-free, or a fallback)
    MIGRATE = "migrate"  # moving, KV and all, from the worker it decodes on to another

    @property
    def streaming(self) -> bool:
        return self in (Phase.DECODE, Phase.WHOLE, Phase.MIGRATE)


class WorkerLost(Exception):
    pass


def prefill_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """The prefill worker's copy: it computes the prompt and samples the first token, then stops
    (the decode worker continues from that token), so min_tokens masks that token as it would."""
    params = replace(request.sampling_params, max_tokens=1, min_tokens=min(request.sampling_params.min_tokens, 1))
    return replace(request, sampling_params=params)


def reserve_request(request: EngineCoreRequest) -> EngineCoreRequest:
    """The decode worker's copy: its prompt's KV arrives computed, so it never scores the prompt
    (the prefill worker's output carries the prompt logprobs); asked to, its scheduler would compute
    the prompt itself rather than take the transfer."""
    if request.sampling_params.prompt_logprobs is None:
        return request
    return replace(request, sampling_params=replace(request.sampling_params, prompt_logprobs=None))


def migrated_request(request: EngineCoreRequest, output_token_ids: list[int]) -> EngineCoreRequest:
    """The target's copy in a migration: the prompt and all but the newest output token, whose KV
    arrives computed (reserved like a prompt), so positions, penalties, seeded noise and stop
    counts carry on as on the source; the newest token comes with the Admit."""
    return reserve_request(replace(request, output_token_ids=tuple(output_token_ids[:-1])))


def first_token_output(request: EngineCoreRequest, first: EngineCoreOutput, max_model_len: int) -> EngineCoreOutput:
    """The prefill worker ran the request with max_tokens 1, so its output always "finished"; the
    request itself did only on a stop, at its own max_tokens, or at the context's end."""
    params = request.sampling_params
    ends = first.finish_reason == "stop" or (params.max_tokens is not None and params.max_tokens <= 1) or \
        request.num_tokens + 1 >= max_model_len
    return first if ends else replace(first, finish_reason=None, finish_time=None)


@dataclass
class Flight:
    request: EngineCoreRequest
    phase: Phase = Phase.ROUTING
    prefill: WorkerHandle | None = None
    decode: WorkerHandle | None = None  # whoever streams the rest of the tokens
    streamed: bool = False
    reply: asyncio.Future | None = None
    task: asyncio.Task | None = None
    keys: list[int] = field(default_factory=list)  # the prompt's full-block keys, as the workers key them
    num_blocks: int = 0  # the prompt's blocks, the partial last one included
    path: str = ""  # the path it took (paths.py), once chosen
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    first_token_at: float | None = None
    num_output_tokens: int = 0

    def workers(self) -> list[WorkerHandle]:
        return [w for w in (self.prefill, self.decode) if w is not None]

    def on_tokens(self, num_new_tokens: int) -> None:
        if self.first_token_at is None and num_new_tokens:
            self.first_token_at = time.monotonic()
        self.num_output_tokens += num_new_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.request.arrival_time

    def tpot_s(self, now: float) -> float | None:
        """Mean time per output token after the first (None: fewer than two tokens)."""
        n = self.num_output_tokens
        return (now - self.first_token_at) / (n - 1) if self.first_token_at is not None and n > 1 else None


def active_blocks(worker: WorkerHandle, flights: Mapping[str, Flight], block_size: int) -> int:
    """The KV blocks of the requests the worker is serving: its decode load, as the router sees it.
    A prefix several of them share is one set of blocks there, so it counts once: else a hot
    prefix's own requests would push new ones sharing it off the worker that caches it."""
    shared: set[int] = set()
    own = 0
    for rid in worker.inflight:
        flight = flights.get(rid)
        if flight is None:
            continue
        shared.update(flight.keys)
        own += -(-flight.request.num_tokens // block_size) - len(flight.keys)
    return len(shared) + own
