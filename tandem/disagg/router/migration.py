"""Live migration at the router: which of a worker's requests move, and where. Each one's flow
(pause, reserve, ship, admit, and the way back from each failure) is Dispatcher.migrate."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from tandem.disagg.router.dispatch import Dispatcher
from tandem.disagg.router.flight import Flight, WorkerLost
from tandem.disagg.router.registry import WorkerHandle, WorkerRegistry
from tandem.disagg.worker.messages import RECEIVING_ROLES

log = logging.getLogger(__name__)


class Migrator:
    def __init__(self, registry: WorkerRegistry, flights: Mapping[str, Flight], dispatch: Dispatcher,
                 fail: Callable[[str, str], None]) -> None:
        self.registry, self.flights, self.dispatch = registry, flights, dispatch
        self.fail = fail  # a request that cannot go on: drop its flight and tell its client why

    async def migrate_from(self, worker_id: str) -> dict[str, Any]:
        """Move every request the worker decodes to the least-loaded other worker that receives KV
        (decode or colocated), one at a time; the worker stays routable. Requests still prefilling
        there stay. KeyError: no live worker by that id."""
        worker = next((w for w in self.registry.live() if w.worker_id == worker_id), None)
        if worker is None:
            raise KeyError(worker_id)
        moved: list[str] = []
        refused: dict[str, str] = {}
        for rid in sorted(worker.inflight):
            flight = self.flights.get(rid)
            if flight is None or flight.decode is not worker or flight.prefill is not None or not flight.streamed:
                continue
            targets = [w for w in self.registry.routable(*RECEIVING_ROLES) if w is not worker]
            if not targets:
                refused[rid] = "no other worker that takes KV"
                continue
            target = min(targets, key=lambda w: (w.load, w.worker_id))
            # The request's own task, so that its client going away cancels the move with it.
            flight.task = asyncio.get_running_loop().create_task(self._move(flight, target))
            try:
                why = await flight.task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise  # this call itself was cancelled, not the request
                why = "aborted"
            if why is None:
                moved.append(rid)
            else:
                refused[rid] = why
        return {"worker": worker_id, "migrated": moved, "not_migrated": refused}

    async def _move(self, flight: Flight, target: WorkerHandle) -> str | None:
        rid = flight.request.request_id
        try:
            why = await self.dispatch.migrate(flight, target)
        except WorkerLost as e:  # the source died: the request's KV went with it
            self.fail(rid, str(e))
            return str(e)
        if why is not None:
            log.warning("request %s stays on %s: %s", rid, flight.decode.worker_id if flight.decode else "-", why)
        return why
