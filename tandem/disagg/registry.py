"""The router's view of its workers: what it knows of each, and how it picks a pair for a request."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from typing import Protocol

from tandem.disagg.worker import WorkerInfo, WorkerStats
from tandem.engine.request import Request


@dataclass
class WorkerHandle:
    info: WorkerInfo
    ident: bytes
    last_seen: float = field(default_factory=time.monotonic)
    stats: WorkerStats | None = None
    alive: bool = True
    inflight: set[str] = field(default_factory=set)
    proc: subprocess.Popen | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def load(self) -> float:
        """Requests assigned and not finished, plus the engine's own queue, as last reported."""
        queued = self.stats.core.num_waiting if self.stats is not None else 0
        return len(self.inflight) + queued


class WorkerSelector(Protocol):
    def choose(self, request: Request, prefill: list[WorkerHandle], decode: list[WorkerHandle]
               ) -> tuple[WorkerHandle | None, WorkerHandle | None]: ...


class LeastLoaded:
    """Fewest requests in flight on each side. Prefix-aware routing replaces this, same signature."""

    def choose(self, request: Request, prefill: list[WorkerHandle], decode: list[WorkerHandle]
               ) -> tuple[WorkerHandle | None, WorkerHandle | None]:
        def pick(ws: list[WorkerHandle]) -> WorkerHandle | None:
            return min(ws, key=lambda w: (w.load, w.worker_id)) if ws else None

        return pick(prefill), pick(decode)
