"""The router's plain data: its settings, a request in flight through it, and its counters."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tandem.disagg.registry import WorkerHandle
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
    # A dead local worker is started again after restart_backoff_s, doubling per quick death, up to the max.
    restart_backoff_s: float = 1.0
    max_restart_backoff_s: float = 30.0


class WorkerLost(Exception):
    pass


@dataclass
class Flight:
    request: Request
    phase: str = "routing"  # routing -> reserve -> prefill -> decode | colocated
    prefill: WorkerHandle | None = None
    decode: WorkerHandle | None = None  # whoever streams the rest of the tokens
    streamed: bool = False
    reply: asyncio.Future | None = None
    task: asyncio.Task | None = None

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
