"""The planner's drain with live migration: the worker it retires hands what it decodes over at
once (the router's migrate_from) and is stopped without waiting for those requests to finish; the
switch time it predicts with is the prompts left to compute there, not the longest output."""

from __future__ import annotations

import asyncio

from tandem.disagg.router.flight import Flight, Phase
from tandem.disagg.router.planner_loop import PlannerLoop
from tandem.disagg.router.registry import WorkerHandle, WorkerRegistry
from tandem.disagg.worker.messages import WorkerInfo
from tandem.engine.core_report import CoreInfo
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import Shutdown
from tandem.policy.planner import PlannerSettings
from tandem.sampling_params import SamplingParams


class Fleet:
    launches, elastic = True, False

    def __init__(self) -> None:
        self.waited: list[int] = []

    def can_grow(self) -> bool:
        return False

    async def wait(self, pid: int, timeout: float) -> None:
        self.waited.append(pid)


def deployment() -> tuple[WorkerRegistry, dict[str, Flight], WorkerHandle]:
    registry = WorkerRegistry(30.0)
    info = CoreInfo(4096, 100, None, 64, "m", block_size=16)
    workers = [registry.join(f"w{i}".encode(), WorkerInfo(f"w{i}", "colocated", info, None, "h", 100 + i, None),
                             local=True) for i in range(2)]
    flights: dict[str, Flight] = {}
    for i, (streamed, prompt) in enumerate(((True, 64), (True, 64), (False, 3000))):
        request = EngineCoreRequest(f"r{i}", tuple(range(prompt)), SamplingParams(max_tokens=500))
        flight = Flight(request, phase=Phase.WHOLE, decode=workers[0], streamed=streamed)
        flights[flight.request.request_id] = flight
        workers[0].inflight.add(flight.request.request_id)
    workers[0].rates.prefill_tok_s, workers[0].rates.step_s = 1000.0, 0.05
    return registry, flights, workers[0]


def test_a_retired_worker_hands_its_streams_over_and_stops_at_once() -> None:
    registry, flights, busy = deployment()
    sent: list[tuple[str, object]] = []
    moved: list[str] = []

    async def send(worker: WorkerHandle, msg: object) -> bool:
        sent.append((worker.worker_id, msg))
        return True

    async def migrate(worker_id: str) -> dict:
        moved.append(worker_id)
        for rid in list(busy.inflight):  # the router moves the decoding ones and the prompt finishes
            busy.inflight.discard(rid)
        return {"migrated": ["r0", "r1"]}

    fleet = Fleet()
    loop = PlannerLoop(PlannerSettings(enabled=True), registry, fleet, send, None, flights, migrate)
    registry.workers[b"w1"].inflight.update({"x", "y", "z", "q"})

    async def retire() -> str | None:
        return await asyncio.wait_for(loop._retire("colocated"), 5)

    assert asyncio.run(retire()) == "w0"
    assert moved == ["w0"] and busy.draining and not busy.alive
    assert [(w, type(m)) for w, m in sent] == [("w0", Shutdown)] and fleet.waited == [100]


def test_the_switch_time_with_migration_is_the_prompts_left_not_the_longest_output() -> None:
    registry, flights, _ = deployment()

    async def send(worker: WorkerHandle, msg: object) -> bool:
        return True

    async def migrate(worker_id: str) -> dict:
        return {}

    draining = PlannerLoop(PlannerSettings(enabled=True), registry, Fleet(), send, None, flights)
    migrating = PlannerLoop(PlannerSettings(enabled=True), registry, Fleet(), send, None, flights, migrate)
    rates = registry.workers[b"w1"].rates
    rates.prefill_tok_s, rates.step_s = 1000.0, 0.05
    registry.workers[b"w1"].inflight.update({"a", "b", "c", "d"})  # busier: w0 is the one a move takes
    # Without migration: the longest output left (500 tokens at the fleet's 50 ms a step).
    assert draining._drain_s("colocated") == 500 * registry.speed(registry.workers[b"w0"]).step_s
    # With it: only the 3,000-token prompt still computing there (at its 1,000 tokens/s).
    assert migrating._drain_s("colocated") == 3000 / registry.speed(registry.workers[b"w0"]).prefill_tok_s
    assert migrating._drain_s("colocated") < draining._drain_s("colocated")
