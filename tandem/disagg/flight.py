"""The router's plain data: its settings, a request in flight through it, and its counters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from tandem.disagg.registry import WorkerHandle
from tandem.engine.core import EngineCoreOutput
from tandem.engine.request import Request


@dataclass
class RouterSettings:
    bind: str = "tcp://127.0.0.1:0"
    secret: bytes = b""
    expected_workers: int = 0  # wait for this many (and at least one) to register before serving
    startup_timeout: float = 300.0
    heartbeat_timeout: float = 5.0
    reserve_timeout: float = 10.0  # how long a request waits for a decode worker's blocks
    prefill_timeout: float = 300.0
    max_attempts: int = 2  # disaggregated tries before running the request colocated
    # A request with at most this many tokens left to prefill (past its best cached overlap) runs on
    # one worker, with no transfer; 0: only when no prefill/decode pair is available.
    max_local_prefill_tokens: int = 0
    # A dead local worker is started again after restart_backoff_s, doubling per quick death, up to the max.
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0


class WorkerLost(Exception):
    pass


def prefill_request(request: Request) -> Request:
    """The prefill worker's copy: it computes the prompt and samples the first token, then stops
    (the decode worker continues from that token), so min_tokens masks that token as it would."""
    params = replace(request.sampling_params, max_tokens=1, min_tokens=min(request.sampling_params.min_tokens, 1))
    return replace(request, sampling_params=params)


def first_token_output(request: Request, first: EngineCoreOutput, max_model_len: int) -> EngineCoreOutput:
    """The prefill worker ran the request with max_tokens 1, so its output always "finished"; the
    request itself did only on a stop, at its own max_tokens, or at the context's end."""
    params = request.sampling_params
    ends = first.finish_reason == "stop" or (params.max_tokens is not None and params.max_tokens <= 1) or \
        request.num_tokens + 1 >= max_model_len
    return first if ends else replace(first, finish_reason=None, finish_time=None)


@dataclass
class Flight:
    request: Request
    phase: str = "routing"  # routing -> reserve -> prefill -> decode | colocated
    prefill: WorkerHandle | None = None
    decode: WorkerHandle | None = None  # whoever streams the rest of the tokens
    streamed: bool = False
    reply: asyncio.Future | None = None
    task: asyncio.Task | None = None
    keys: list[int] = field(default_factory=list)  # the prompt's full-block keys, as the workers key them
    num_blocks: int = 0  # the prompt's blocks, the partial last one included
    first_token_at: float | None = None  # what the planner measures
    num_output_tokens: int = 0

    def workers(self) -> list[WorkerHandle]:
        return [w for w in (self.prefill, self.decode) if w is not None]


@dataclass
class RouterCounters:
    reserve_wait_s: list[float] = field(default_factory=list)  # drained by the metrics exporter
    retries: int = 0
    fallbacks: int = 0
    worker_deaths: int = 0
    disaggregated: int = 0
    colocated: int = 0
    prefill_free: int = 0  # sent straight to a decode worker: the store held all of the prompt but its tail
    routed: dict[str, int] = field(default_factory=dict)  # path (disaggregated, colocated, ...) -> requests
    overlap_blocks: dict[str, int] = field(default_factory=dict)  # worker id -> cached blocks of routed prompts
    prompt_blocks: dict[str, int] = field(default_factory=dict)  # worker id -> full blocks of routed prompts

    def count_route(self, path: str, worker_id: str, overlap: int, num_blocks: int) -> None:
        self.routed[path] = self.routed.get(path, 0) + 1
        self.overlap_blocks[worker_id] = self.overlap_blocks.get(worker_id, 0) + overlap
        self.prompt_blocks[worker_id] = self.prompt_blocks.get(worker_id, 0) + num_blocks
