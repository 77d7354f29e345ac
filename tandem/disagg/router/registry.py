"""The router's view of its workers: who is there, alive and taking requests, what each last
reported, how fast it is (latency.py) and which prompt blocks it holds (prefix_index.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.disagg.worker.messages import WorkerInfo, WorkerStats
from tandem.engine.core_report import CoreStats, sum_stats
from tandem.policy.deadlines import EngineShape
from tandem.policy.latency import Speed, WorkerRates, fleet_shape, fleet_speed
from tandem.policy.prefix_index import PrefixIndex

# Roles whose engine can prefill for another worker, and those that hold a pool KV lands in.
PREFILL_CAPABLE = ("prefill", "colocated")


@dataclass
class WorkerHandle:
    info: WorkerInfo
    ident: bytes
    last_seen: float = field(default_factory=time.monotonic)
    stats: WorkerStats | None = None
    alive: bool = True
    inflight: set[str] = field(default_factory=set)
    local: bool = False  # its process is one the router started (fleet/owner.py): watched and restarted there
    joined: float = field(default_factory=time.monotonic)
    draining: bool = False  # the planner is taking it out of its pool: no new requests
    rates: WorkerRates = field(default_factory=WorkerRates)

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


class WorkerRegistry:
    def __init__(self, predict_ttl_s: float) -> None:
        self.workers: dict[bytes, WorkerHandle] = {}
        self.index = PrefixIndex(predict_ttl_s)

    def get(self, ident: bytes) -> WorkerHandle | None:
        return self.workers.get(ident)

    def join(self, ident: bytes, info: WorkerInfo, local: bool = False) -> WorkerHandle | None:
        """A worker registered (local: in a process the router started): the new handle, or None when it
        was known and alive (a repeat)."""
        old = self.workers.get(ident)
        if old is not None and old.alive:
            old.info = info
            return None
        worker = WorkerHandle(info, ident, local=local)
        self.index.forget(info.worker_id)  # a new or restarted worker: its pool is empty
        self.workers[ident] = worker
        return worker

    def report(self, worker: WorkerHandle, stats: WorkerStats) -> None:
        worker.stats = stats
        worker.last_seen = time.monotonic()
        worker.rates.observe(stats)

    def drop(self, worker: WorkerHandle) -> None:
        worker.alive = False
        self.index.forget(worker.worker_id)

    def live(self, role: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def routable(self, *roles: str) -> list[WorkerHandle]:
        """Live workers of these roles (any, without) that take new requests (not being drained)."""
        return [w for w in self.workers.values() if w.alive and not w.draining and (not roles or w.role in roles)]

    def silent_or_exited(self, heartbeat_timeout: float,
                         exit_code: Callable[[int], int | None]) -> list[tuple[WorkerHandle, str]]:
        """Live workers to declare dead, and why; exit_code(pid): a local worker's, None while it runs."""
        now = time.monotonic()
        out = []
        for w in self.workers.values():
            if not w.alive:
                continue
            code = exit_code(w.info.pid) if w.local else None
            if code is not None:
                out.append((w, f"worker {w.worker_id} exited (code {code})"))
            elif now - w.last_seen > heartbeat_timeout:
                out.append((w, f"worker {w.worker_id} stopped responding"))
        return out

    def speed(self, worker: WorkerHandle) -> Speed:
        return fleet_speed(worker.rates, (w.rates for w in self.live()))

    def serving(self) -> list[WorkerHandle]:
        """The live workers that stream tokens: the decode workers (every live worker without)."""
        return self.live("decode") or self.live()

    def shape(self, budget: int, contended_chunk: int) -> EngineShape | None:
        """The fleet as one engine for admission. A fleet of one is that engine: its profiled step times
        as its last report moved them (engine/speed.py), as the single server predicts. Else
        latency.fleet_shape over measured rates: prompts on the workers that are not decode workers
        (all of them without), tokens streamed by the serving ones."""
        live = self.live()
        if len(live) == 1 and live[0].info.core.speed is not None:
            one = live[0]
            speed = (one.stats.core.speed if one.stats is not None else None) or one.info.core.speed
            return EngineShape(speed, 1.0, budget, one.info.core.max_num_seqs, contended_chunk)
        prompt = [w for w in live if w.role != "decode"] or live
        serving = self.serving()
        return fleet_shape([self.speed(w) for w in prompt], [self.speed(w) for w in serving], budget,
                           sum(w.info.core.max_num_seqs for w in serving), contended_chunk)

    def combined_stats(self) -> CoreStats | None:
        """The deployment's engine stats: the sum over the live workers that have reported."""
        return sum_stats([w.stats.core for w in self.live() if w.stats is not None])
