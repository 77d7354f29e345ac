"""The planner at work in the router: hears of each arrival and finished request, asks the Planner
every interval (with the workers' roles and measured prefill capacity), and carries out its
decisions by flipping a local worker's role.

A flip drains the worker first (no new requests are routed to it; the ones it serves finish), then
stops it and starts a worker of the other role on the same cores, which joins like any worker.
Nothing in flight fails. Only local workers (started by this router) can be flipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from tandem.disagg.messages import ROLES
from tandem.disagg.planner import Planner, PlannerAction, PlannerSettings
from tandem.disagg.registry import PREFILL_CAPABLE
from tandem.engine.messages import Shutdown

if TYPE_CHECKING:
    from tandem.disagg.registry import WorkerHandle
    from tandem.disagg.router import DisaggEngine

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 300.0


class PlannerLoop:
    def __init__(self, engine: DisaggEngine, settings: PlannerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.planner = Planner(settings)
        self.flips: dict[tuple[str, str], int] = {}  # (from role, to role) -> flips carried out

    def observe(self, ttft_s: float, tpot_s: float | None) -> None:
        self.planner.observe(ttft_s, tpot_s)

    def observe_arrival(self, prompt_tokens: int) -> None:
        self.planner.observe_arrival(prompt_tokens)

    def decide(self) -> PlannerAction | None:
        reg = self.engine.registry
        workers = reg.routable()
        roles = {role: sum(w.role == role for w in workers) for role in ROLES}
        capable = [reg.speed(w).prefill_tok_s for w in workers if w.role in PREFILL_CAPABLE]
        return self.planner.decide(roles, sum(capable) if capable else None)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            action = self.decide()
            if action is not None:
                log.warning("planner: %s -> %s: %s", action.from_role, action.to_role, action.reason)
                try:
                    await self.flip(action)
                except Exception:  # the deployment keeps serving with the split it has
                    log.exception("planner: the flip failed")

    async def flip(self, action: PlannerAction) -> None:
        e = self.engine
        launch = e.launch
        local = [w for w in e.registry.routable(action.from_role) if w.proc is not None and launch is not None]
        if not local:
            log.warning("planner: no local %s worker to flip", action.from_role)
            return
        worker: WorkerHandle = min(local, key=lambda w: (w.load, w.worker_id))
        worker.draining = True
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while worker.inflight and worker.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if not worker.alive:
            return  # it died while draining: the restarter brings it back as it was
        if worker.inflight:
            log.warning("planner: %s did not drain in %.0f s; it stays a %s worker", worker.worker_id,
                        DRAIN_TIMEOUT_S, action.from_role)
            worker.draining = False
            return
        worker.alive = False  # retired, not dead: nothing reroutes or restarts it
        await e._send(worker, Shutdown())
        assert worker.proc is not None
        await asyncio.get_running_loop().run_in_executor(None, worker.proc.wait, 30)
        _, cores = launch.roles.pop(worker.worker_id)
        new_id = next(f"{action.to_role}-{i}" for i in range(len(launch.roles) + 1)
                      if f"{action.to_role}-{i}" not in launch.roles)
        launch.roles[new_id] = (action.to_role, cores)
        e._procs.append(launch.start(new_id, e.address))
        key = (action.from_role, action.to_role)
        self.flips[key] = self.flips.get(key, 0) + 1
        log.warning("planner: %s drained and stopped; %s starts on cores %s", worker.worker_id, new_id, cores)
