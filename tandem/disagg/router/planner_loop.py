"""The planner at work in the router: hears of each arrival and finished request, asks the Planner
every interval (with the workers' roles and measured prefill capacity), and carries out its
decisions by flipping a local worker's role, or, on an elastic launcher (Ray), by placing a worker
more or releasing one. It acts through what the router hands it: the registry (to read), a
WorkerControl (the router's WorkerFleet: the launcher's workers) and a send (a message to a worker).

A flip drains the worker first (no new requests are routed to it), then stops it and starts a
worker of the other role on the same cores, which joins like any worker. Draining moves the
requests it decodes to other workers, KV and all (a live migration, the router's migrate_from),
and waits only for those still in their prompt; without migration they all finish where they are.
Nothing in flight fails. Only local workers (started by this router) can be flipped.

With a predictor it also hands the planner the requests in flight (what the next horizon inherits)
and how long a move from each role would take: the drain (with migration, the prompts left to
compute on the worker it would drain; without, its longest remaining output at its step time),
plus a start-up as the last one measured.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from tandem.disagg.fleet.launcher import WorkerSpec
from tandem.disagg.router.flight import Flight
from tandem.disagg.router.registry import PREFILL_CAPABLE, WorkerHandle, WorkerRegistry
from tandem.disagg.worker.messages import ROLES
from tandem.engine.messages import Shutdown
from tandem.policy.planner import ASSUMED_OUTPUT_TOKENS, Planner, PlannerAction, PlannerSettings
from tandem.policy.prediction import Prediction, Predictor

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
JOIN_TIMEOUT_S = 300.0
ACTIONS_KEPT = 100

Send = Callable[[WorkerHandle, object], Awaitable[bool]]  # a message to a worker; False: it is gone
Migrate = Callable[[str], Awaitable[object]]  # move what a worker (by id) decodes to others


class WorkerControl(Protocol):
    """What the planner may do to the workers the router started (fleet/owner.py's WorkerFleet)."""

    @property
    def launches(self) -> bool:
        """There are local workers to move at all (the router has a launcher)."""

    @property
    def elastic(self) -> bool: ...

    def can_grow(self) -> bool: ...

    def spec(self, worker_id: str) -> WorkerSpec: ...

    async def wait(self, pid: int, timeout: float) -> None:
        """Until the process exits (subprocess.TimeoutExpired after timeout)."""

    def change_role(self, worker_id: str, role: str) -> str:
        """The stopped worker's cores to a new worker of the role, started; its id."""

    def add(self, role: str) -> str:
        """Elastic: a new worker of the role, started; its id."""

    def release(self, worker_id: str) -> None:
        """The stopped worker leaves the deployment; its cores are free."""


class PlannerLoop:
    def __init__(self, settings: PlannerSettings, registry: WorkerRegistry, workers: WorkerControl,
                 send: Send, predictor: Predictor | None = None, flights: Mapping[str, Flight] | None = None,
                 migrate: Migrate | None = None) -> None:
        self.registry, self.workers, self.send, self.migrate = registry, workers, send, migrate
        self.settings = settings
        self.planner = Planner(settings, predictor=predictor)
        self.flights: Mapping[str, Flight] = flights if flights is not None else {}
        self.startup_s = settings.startup_s  # the last new worker's, from its start to its joining
        self.flips: dict[tuple[str, str], int] = {}  # (from role, to role) -> flips carried out
        self.actions: deque[dict] = deque(maxlen=ACTIONS_KEPT)  # what it decided, for the dashboard's timeline

    def observe(self, ttft_s: float, tpot_s: float | None, arrived_at: float | None = None,
                output_tokens: int | None = None) -> None:
        self.planner.observe(ttft_s, tpot_s, arrived_at, output_tokens)

    def observe_arrival(self, prompt_tokens: int, max_tokens: int | None = None) -> None:
        self.planner.observe_arrival(prompt_tokens, max_tokens)

    def _inputs(self) -> tuple[dict[str, int], float | None, bool, bool]:
        reg = self.registry
        workers = reg.routable()
        roles = {role: sum(w.role == role for w in workers) for role in ROLES}
        capable = [reg.speed(w).prefill_tok_s for w in workers if w.role in PREFILL_CAPABLE]
        # An elastic launcher (Ray) can place a worker more when the cluster has room, and let one go.
        elastic = self.workers.elastic
        return roles, sum(capable) if capable else None, elastic and self.workers.can_grow(), elastic

    def decide(self) -> PlannerAction | None:
        """The reactive planner's decision (the predictive one runs in decide_async)."""
        roles, capacity, can_grow, can_shrink = self._inputs()
        return self.planner.decide(roles, capacity, can_grow, can_shrink)

    async def decide_async(self) -> PlannerAction | None:
        """Predictive: the question is put on the event loop (it reads the live state), the simulator
        answers it in a thread so that routing and streaming go on meanwhile."""
        predictor = self.planner.predictor
        if predictor is None:
            return self.decide()
        roles, _, can_grow, can_shrink = self._inputs()
        backlog = [(f.request.num_prompt_tokens, self._left(f)) for f in self.flights.values()]
        switch = {role: self._drain_s(role) + self.startup_s for role in ROLES}
        question = self.planner.ask(roles, can_grow, can_shrink, backlog, switch)
        if question is None:
            return None

        def answer() -> tuple[list[Prediction], float]:
            start = time.thread_time()  # the thread's own CPU: waiting for a core it shares is not its cost
            return question.answer(predictor), time.thread_time() - start

        predictions, cpu_s = await asyncio.to_thread(answer)
        return self.planner.conclude(question, predictions, cpu_s)

    @staticmethod
    def _left(flight: Flight) -> int:
        wanted = flight.request.sampling_params.max_tokens or ASSUMED_OUTPUT_TOKENS
        return max(wanted - flight.num_output_tokens, 1)

    def _drain_s(self, role: str) -> float:
        """How long the worker a move from this role would take (the least loaded local one) needs to
        finish what it serves: its longest remaining output at its step time."""
        local = [w for w in self.registry.routable(role) if w.local]
        if not local:
            return 0.0
        worker = min(local, key=lambda w: (w.load, w.worker_id))
        flights = [f for rid in worker.inflight if (f := self.flights.get(rid)) is not None]
        speed = self.registry.speed(worker)
        if self.migrate is not None:  # what decodes moves at once; prompts in progress finish there
            prompts = sum(f.request.num_prompt_tokens for f in flights if not f.streamed)
            return prompts / speed.prefill_tok_s if prompts and speed.prefill_tok_s > 0 else 0.0
        return max((self._left(f) for f in flights), default=0) * speed.step_s

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                action = await self.decide_async()
            except Exception:  # a prediction that fails leaves the split as it is
                log.exception("planner: the decision failed")
                continue
            if action is not None:
                log.warning("planner: %s -> %s: %s", action.from_role, action.to_role, action.reason)
                record = {"t": time.time(), "from_role": action.from_role, "to_role": action.to_role,
                          "reason": action.reason, "outcome": "started",
                          "predicted_goodput": action.predicted_goodput, "baseline_goodput": action.baseline_goodput}
                self.actions.append(record)
                try:
                    record["outcome"] = "done" if await self.flip(action) else "not carried out"
                except Exception:  # the deployment keeps serving with the split it has
                    record["outcome"] = "failed"
                    log.exception("planner: the flip failed")

    def view(self) -> dict:
        p = self.planner
        out = {"enabled": True, "interval_s": self.settings.interval_s, "forecast_prompt_tok_s": p.last_forecast_tok_s,
               "actions": list(self.actions), "predictive": p.predictor is not None}
        if p.predictor is not None:
            out["predictions"] = p.predictions.view(p.clock())
            out["last_scores"] = [{"option": c.describe(), "predicted_goodput": pr.goodput_rps,
                                   "ttft_p90_s": pr.ttft_p90_s, "tpot_p90_s": pr.tpot_p90_s}
                                  for c, pr in p.last_scores]
            out["startup_s"] = self.startup_s
            out["predict_cpu_s"] = p.predict_cpu_s
        return out

    async def flip(self, action: PlannerAction) -> bool:
        """Carry out an action: a role change (drain, stop, start the other role on its cores), or on an
        elastic launcher a worker more (empty from_role) or fewer (empty to_role). False: not done."""
        fleet = self.workers
        if not fleet.launches:
            return False
        new_id = None
        if action.from_role:
            retired = await self._retire(action.from_role)
            if retired is None:
                return False
            if action.to_role:
                new_id = fleet.change_role(retired, action.to_role)
            else:
                fleet.release(retired)
        elif action.to_role:
            new_id = fleet.add(action.to_role)
        key = (action.from_role, action.to_role)
        self.flips[key] = self.flips.get(key, 0) + 1
        if new_id is not None:
            log.warning("planner: %s starts on cores %s", new_id, fleet.spec(new_id).cores)
            await self._joined(new_id)
        return True

    async def _joined(self, worker_id: str) -> None:
        """Until the new worker joins: how long that took is the next move's start-up."""
        started = time.monotonic()
        while time.monotonic() - started < JOIN_TIMEOUT_S:
            if any(w.worker_id == worker_id for w in self.registry.live()):
                self.startup_s = time.monotonic() - started
                log.warning("planner: %s joined after %.1f s", worker_id, self.startup_s)
                return
            await asyncio.sleep(0.2)

    async def _retire(self, role: str) -> str | None:
        """Drain the least-loaded local worker of the role and stop it; its id (None: none could go)."""
        local = [w for w in self.registry.routable(role) if w.local]
        if not local:
            log.warning("planner: no local %s worker to take", role)
            return None
        worker = min(local, key=lambda w: (w.load, w.worker_id))
        worker.draining = True
        if self.migrate is not None and worker.inflight:
            log.warning("planner: moving %s's requests: %s", worker.worker_id, await self.migrate(worker.worker_id))
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
        await self.send(worker, Shutdown())
        await self.workers.wait(worker.info.pid, STOP_TIMEOUT_S)
        log.warning("planner: %s drained and stopped", worker.worker_id)
        return worker.worker_id
