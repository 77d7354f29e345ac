"""The engine service loop: one engine core serving the requests that arrive as messages.

Every worker (disagg/worker/cluster_worker.py; the single server's one engine is a lone colocated
worker) runs this loop; each provides only how messages travel (`receive`, `send`)
and what it adds around the engine (the worker's KV transfers, through the hooks). Messages are
dispatched by type through a table a subclass extends.

While the engine has work it steps back to back, taking whatever arrived in between; idle, it
blocks on input for up to a heartbeat. It reports its stats with every step's outputs and, when
there are none, at least once per heartbeat, so whoever watches it can tell it is alive.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable
from typing import Any

from tandem.engine.core import EngineCore
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_report import core_stats
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import (
    AbortRequests,
    AddRequests,
    KVEvents,
    ReleaseKV,
    RequestsFailed,
    Shutdown,
    StepOutputs,
)
from tandem.engine.request import Request
from tandem.parallel.shm import GroupFailed

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.1  # the longest an engine goes without reporting; also how long an idle one waits for input
PENDING_POLL_S = 0.005  # idle engine, but work outside it (a transfer landing) to check on soon


class EngineService:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.handlers: dict[type, Callable[[Any], None]] = {
            AddRequests: lambda m: [self.add(r) for r in m.requests],
            AbortRequests: lambda m: self.abort(m.request_ids),
            ReleaseKV: lambda m: [self.core.scheduler.kv.release(h) for h in m.handles],
            Shutdown: lambda m: self.stop(),
        }
        self.stopping = False
        self._last_report = 0.0
        self._kv_seq = 0

    # -- what a host provides -----------------------------------------------------------------
    def receive(self, timeout_s: float) -> list[object]:
        """The messages that arrived, waiting up to timeout_s for the first."""
        raise NotImplementedError

    def send(self, msg: object) -> None:
        raise NotImplementedError

    def stats(self) -> object:
        return core_stats(self.core)

    def on_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """A step's outputs, before they are reported: a host may keep some back."""
        return outputs

    def pending(self) -> bool:
        """Work outside the engine that `tick` must check on soon."""
        return False

    def tick(self) -> None:
        """After every turn of the loop."""

    # -- requests -----------------------------------------------------------------------------
    def add(self, request: EngineCoreRequest) -> bool:
        try:
            self.core.add_request(Request.from_core_request(request))
            return True
        except ValueError as e:  # e.g. an id still in use here: fail the request, not the engine
            self.send(RequestsFailed([request.request_id], str(e)))
            return False

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    def stop(self) -> None:
        self.stopping = True

    def handle(self, msg: object) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            log.warning("ignoring a message of unknown type %s", type(msg).__name__)
            return
        handler(msg)

    # -- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        self._report([])  # at once: whoever waits for it to start learns its pool before any step
        while not self.stopping:
            busy = self.core.has_unfinished()
            for msg in self.receive(0.0 if busy else PENDING_POLL_S if self.pending() else HEARTBEAT_S):
                try:
                    self.handle(msg)
                except Exception:  # one bad message must not take the other requests down
                    log.exception("failed to handle %s", type(msg).__name__)
                if self.stopping:
                    return
            if self.core.has_unfinished():
                self._step()
            self.tick()
            if time.monotonic() - self._last_report >= HEARTBEAT_S:
                self._guard_group(self.core.check_alive)  # a report says the whole group lives
                self._report([])

    def _guard_group(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except GroupFailed as e:
            # A rank of the worker group died: fail what is in flight, and end the loop (the process
            # exits; its owner, the router's fleet, starts the whole group again with its backoff).
            self.send(RequestsFailed(self.core.request_ids(), f"engine error: {e}"))
            raise

    def _step(self) -> None:
        try:
            outputs = self._guard_group(self.core.step)
        except GroupFailed:
            raise
        except Exception as e:
            # A failed step fails the requests in it, not the engine: free them and carry on.
            log.error("engine step failed: %s", traceback.format_exc())
            failed = self.core.request_ids()
            self.abort(failed)
            self.send(RequestsFailed(failed, f"engine error: {type(e).__name__}: {e}"))
            return
        for out in outputs:
            if out.error is not None:  # it failed alone: a 500 for it, nobody else
                self.abort([out.request_id])
                self.send(RequestsFailed([out.request_id], out.error))
        outputs = self.on_outputs([o for o in outputs if o.error is None])
        if outputs:
            self._report(outputs)
        events = self.core.take_kv_events()
        if events:
            self.send(KVEvents(events, self._kv_seq))
            self._kv_seq += 1

    def _report(self, outputs: list[EngineCoreOutput]) -> None:
        self.send(StepOutputs(outputs, self.stats()))
        self._last_report = time.monotonic()

    def close(self) -> None:
        self.abort(self.core.request_ids())
        self.core.close()
