"""The planner at work in the router: hears of each arrival and finished request, asks the Planner
every interval (with the workers' roles and measured prefill capacity), and carries out its
decisions by flipping a local worker's role, or, on an elastic launcher (Ray), by placing a worker
more or releasing one.

A flip drains the worker first (no new requests are routed to it; the ones it serves finish), then
stops it and starts a worker of the other role on the same cores, which joins like any worker.
Nothing in flight fails. Only local workers (started by this router) can be flipped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
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
ACTIONS_KEPT = 100


class PlannerLoop:
    def __init__(self, engine: DisaggEngine, settings: PlannerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.planner = Planner(settings)
        self.flips: dict[tuple[str, str], int] = {}  # (from role, to role) -> flips carried out
        self.actions: deque[dict] = deque(maxlen=ACTIONS_KEPT)  # what it decided, for the dashboard's timeline

    def observe(self, ttft_s: float, tpot_s: float | None) -> None:
        self.planner.observe(ttft_s, tpot_s)

    def observe_arrival(self, prompt_tokens: int) -> None:
        self.planner.observe_arrival(prompt_tokens)

    def decide(self) -> PlannerAction | None:
        reg = self.engine.registry
        workers = reg.routable()
        roles = {role: sum(w.role == role for w in workers) for role in ROLES}
        capable = [reg.speed(w).prefill_tok_s for w in workers if w.role in PREFILL_CAPABLE]
        # An elastic launcher (Ray) can place a worker more when the cluster has room, and let one go.
        launch = self.engine.launch
        elastic = launch is not None and hasattr(launch, "can_grow")
        return self.planner.decide(roles, sum(capable) if capable else None, elastic and launch.can_grow(), elastic)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            action = self.decide()
            if action is not None:
                log.warning("planner: %s -> %s: %s", action.from_role, action.to_role, action.reason)
                record = {"t": time.time(), "from_role": action.from_role, "to_role": action.to_role,
                          "reason": action.reason, "outcome": "started"}
                self.actions.append(record)
                try:
                    record["outcome"] = "done" if await self.flip(action) else "not carried out"
                except Exception:  # the deployment keeps serving with the split it has
                    record["outcome"] = "failed"
                    log.exception("planner: the flip failed")

    def view(self) -> dict:
        return {"enabled": True, "interval_s": self.settings.interval_s,
                "forecast_prompt_tok_s": self.planner.last_forecast_tok_s, "actions": list(self.actions)}

    async def flip(self, action: PlannerAction) -> bool:
        """Carry out an action: a role change (drain, stop, start the other role on its cores), or on an
        elastic launcher a worker more (empty from_role) or fewer (empty to_role). False: not done."""
        launch = self.engine.launch
        if launch is None:
            return False
        if action.from_role:
            cores = await self._retire(action.from_role)
            if cores is None:
                return False
        else:
            cores = launch.new_slot()
        if action.to_role:
            new_id = next(f"{action.to_role}-{i}" for i in range(len(launch.roles) + 1)
                          if f"{action.to_role}-{i}" not in launch.roles)
            launch.roles[new_id] = (action.to_role, cores)
            self.engine._procs.append(launch.start(new_id, self.engine.address))
            log.warning("planner: %s starts on cores %s", new_id, cores)
        key = (action.from_role, action.to_role)
        self.flips[key] = self.flips.get(key, 0) + 1
        return True

    async def _retire(self, role: str) -> list[int] | None:
        """Drain the least-loaded local worker of the role and stop it; its cores (None: none could go)."""
        e = self.engine
        launch = e.launch
        local = [w for w in e.registry.routable(role) if w.proc is not None and launch is not None]
        if not local:
            log.warning("planner: no local %s worker to take", role)
            return None
        worker: WorkerHandle = min(local, key=lambda w: (w.load, w.worker_id))
        worker.draining = True
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while worker.inflight and worker.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if not worker.alive:
            return None  # it died while draining: the restarter brings it back as it was
        if worker.inflight:
            log.warning("planner: %s did not drain in %.0f s; it stays a %s worker", worker.worker_id,
                        DRAIN_TIMEOUT_S, role)
            worker.draining = False
            return None
        worker.alive = False  # retired, not dead: nothing reroutes or restarts it
        await e._send(worker, Shutdown())
        assert worker.proc is not None
        await asyncio.get_running_loop().run_in_executor(None, worker.proc.wait, 30)
        _, cores = launch.roles.pop(worker.worker_id)
        log.warning("planner: %s drained and stopped", worker.worker_id)
        return cores
