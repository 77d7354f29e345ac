"""The router: a cluster's engine client, behind the same HTTP API as one local engine.

It owns the socket its workers connect to and the deployment's lifecycle; each message a worker
sends is dispatched by type (disagg/worker/messages.py) to the part that owns its state:
  registry.py      the workers: liveness, stats, speed, the prefix index;
  policy/routing.py  which worker of a pool a request goes to; policy/paths.py which path it takes;
  dispatch.py      each request's flow along its path (flight.py: its state);
  fleet/owner.py   the worker processes it started (through a launcher);
  planner_loop.py  the SLO planner moving workers between pools.
A worker that stops heart-beating, or whose process exits, is dropped: its requests that have not
streamed a token are routed again, the others fail with a clear error, and serving goes on with
the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.disagg.fleet.launcher import Launcher
from tandem.disagg.fleet.owner import WorkerFleet
from tandem.disagg.fleet.restarts import Restarter
from tandem.disagg.router.dispatch import Dispatcher
from tandem.disagg.router.engine_client import EngineClient, EngineDeadError, EngineRequestError
from tandem.disagg.router.flight import Flight, WorkerLost, active_blocks
from tandem.disagg.router.kv_events_pub import KVEventsPublisher
from tandem.disagg.router.metrics import ClusterSnapshot, DisaggMetrics, MetricsSink
from tandem.disagg.router.migration import Migrator
from tandem.disagg.router.planner_loop import PlannerLoop
from tandem.disagg.router.registry import WorkerHandle, WorkerRegistry
from tandem.disagg.router.settings import RouterCounters, RouterSettings
from tandem.disagg.router.store_view import StoreView
from tandem.disagg.router.view import cluster_health, cluster_snapshot, cluster_view
from tandem.disagg.worker import secure, wire
from tandem.disagg.worker.messages import Aborted, Alive, FlightReply, Forget, Hello, Register
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import KVEvents, ReleaseKV, RequestsFailed, Shutdown, StepOutputs
from tandem.logs import startup
from tandem.policy.deadlines import EngineShape
from tandem.policy.planner import PlannerSettings
from tandem.policy.prediction import Predictor
from tandem.policy.routing import Router, RoutingSettings

log = logging.getLogger(__name__)

REFUSED_PEERS = 1024  # peers whose refusal was logged; an identity is chosen by the peer, so bound them


class DisaggEngine(EngineClient):
    def __init__(self, config: EngineConfig, tokenizer: Any | None, settings: RouterSettings,
                 launch: Launcher | None = None,  # the workers this router starts (None: all remote)
                 routing: RoutingSettings | None = None, planner: PlannerSettings | None = None,
                 predictor: Predictor | None = None) -> None:
        super().__init__(tokenizer)
        self.config = config
        self.settings = settings
        routing = routing or RoutingSettings()
        self.registry = WorkerRegistry(routing.predict_ttl_s)
        self.flights: dict[str, Flight] = {}
        self.counters = RouterCounters()
        self.router = Router(routing, self.registry.index, self._active_blocks)
        self.dispatch = Dispatcher(settings, self.registry, self.router, routing.slo, routing.paths, self._send,
                                   self._deliver_outputs, self.counters)
        self.dispatch.expecting_worker = lambda: self.restarter.pending() or self.fleet.starting(
            {w.info.pid for w in self.registry.workers.values()})
        self.migrator = Migrator(self.registry, self.flights, self.dispatch, self._fail_request)
        self.fleet = WorkerFleet(launch)
        self.planning = (PlannerLoop(planner, self.registry, self.fleet, self._send, predictor, self.flights,
                                     self.migrate_from if settings.migrate else None)
                         if planner is not None and planner.enabled else None)
        self.address = ""
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished worker raises, not drops
        # A worker started again connects with its old identity (its id), and the dead one's connection
        # may not have closed yet (a remote host that died sends no FIN): without handover ZeroMQ would
        # drop every message of the new one until then.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        secure.server(self._sock, settings.secret, settings.bind, wire.MAX_CONTROL_FRAME)
        self._channel = wire.Channel(settings.secret)
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._kv_pub = KVEventsPublisher.bind(self._ctx, settings.kv_events_endpoint)
        self.restarter = Restarter(self.fleet.start, settings.restart_backoff_s, settings.max_restart_backoff_s)
        self._refused: wire.LRU[bytes, None] = wire.LRU(REFUSED_PEERS)
        self._handlers: dict[type, Callable[[WorkerHandle, Any], Any]] = {
            StepOutputs: self._on_outputs,
            KVEvents: self._on_kv_events,
            Aborted: lambda w, m: self.dispatch.on_aborted(m.request_ids),
            RequestsFailed: self._on_failed,
            Alive: lambda w, m: None,  # its arrival is the news (last_seen)
        }

    @property
    def store(self) -> StoreView | None:
        return self.dispatch.store

    @property
    def workers(self) -> dict[bytes, WorkerHandle]:
        return self.registry.workers

    # -- lifecycle ----------------------------------------------------------------------------
    def launch(self) -> None:
        """Bind the workers' socket and start the workers this router launches. Synchronous, so a server
        calls it before its own imports and tokenizer load, which then overlap the workers' start (their
        messages wait in the socket until start() reads them); start() does it if nobody did."""
        if self.address:
            return
        bind = self.settings.bind
        if bind.startswith("tcp://") and bind.endswith(":0"):
            port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self._sock.bind(bind)
            self.address = bind
        startup.info("router listening on %s for workers", self.address)
        started = self.fleet.start_all(self.address)
        if self.fleet.launches:
            startup.info("started %d local workers; waiting for them to join", started)
        else:
            startup.info("waiting for a worker to join (tandem worker --router %s)", self.address)

    async def start(self) -> None:
        self.launch()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        if self.planning is not None:
            self._tasks.append(asyncio.create_task(self.planning.run()))
        try:
            await self._wait_for_workers()
        except BaseException:
            self.fleet.kill_all()  # leave no orphan behind a failed start
            raise

    async def _wait_for_workers(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout
        # At least one: the API needs a worker's model limits before it can validate anything.
        while len(self.registry.live()) < max(self.settings.expected_workers, 1):
            codes = self.fleet.start_up_exits()
            if codes is not None:
                raise RuntimeError(f"a worker exited during start-up (exit codes {codes})")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register in time")
            await asyncio.sleep(0.1)

    async def shutdown(self) -> None:
        self.restarter.stop()
        for rid in list(self.streams):
            self._fail(rid, EngineDeadError("server shutting down"))
        told = [w for w in self.registry.live() if await self._send(w, Shutdown())]
        for task in self._tasks:
            task.cancel()
        # A process still starting (a worker started again, not yet joined) was told nothing, and holds
        # no request: it goes at once rather than after the others' grace period.
        await self.fleet.wait_all(10, told={w.info.pid for w in told if w.local})
        if self.store is not None:
            self.store.close()
        secure.release(self._sock)
        self._sock.close(linger=0)
        if self._kv_pub is not None:
            self._kv_pub.close()
        self._ctx.term()

    def attach_metrics(self, metrics: MetricsSink) -> None:  # type: ignore[override]
        super().attach_metrics(metrics)  # type: ignore[arg-type]
        exporter = DisaggMetrics(metrics.registry, metrics.model_name)
        metrics.collectors.append(lambda: exporter.collect(self._snapshot()))

    def _snapshot(self) -> ClusterSnapshot:
        return cluster_snapshot(self.registry, self.counters, self.restarter.count, self.planning)

    @property
    def healthy(self) -> bool:
        return self.dead is None and bool(self.registry.live())

    def cluster(self) -> dict[str, Any]:
        return cluster_view(self.registry, self.counters, self.address, len(self.flights), self.restarter.count,
                            self.planning)

    def cached_blocks(self, keys: list[int]) -> int:
        """The most of the prompt's blocks any live worker holds (its KV events and recent routes)."""
        return max((self.registry.index.overlap(w.worker_id, keys) for w in self.registry.live()), default=0)

    def capacity(self) -> int:
        """Sequences the deployment runs at once: its decode workers' (every live worker's without)."""
        return sum(w.info.core.max_num_seqs for w in self.registry.serving()) or 1

    def shape(self) -> EngineShape | None:
        """The fleet as one engine, from its workers' measured rates: admission predicts as for one engine."""
        chunk = self.info.contended_prefill_chunk if self.info is not None else 0
        return self.registry.shape(self.step_budget, chunk)

    def health(self) -> dict[str, Any]:
        return cluster_health(self.registry, self.healthy, self.dead)

    # -- messaging ----------------------------------------------------------------------------
    async def _send(self, worker: WorkerHandle, msg: object) -> bool:
        try:
            await self._sock.send_multipart([worker.ident, *self._channel.sign(msg)])
            return True
        except zmq.ZMQError as e:  # the peer is gone (ROUTER_MANDATORY)
            log.warning("cannot reach worker %s: %s", worker.worker_id, e)
            return False

    async def _read(self) -> None:
        while True:
            ident, *frames = await self._sock.recv_multipart()
            try:
                msg, _ = self._channel.verify(frames)
            except wire.AuthError as e:
                if ident not in self._refused:  # once per peer: an intruder heart-beats 10 times a second
                    self._refused.put(ident, None)
                    log.warning("refusing messages from %r: %s", ident, e)
                continue
            try:
                await self._on_message(ident, msg)
            except Exception:
                log.exception("router failed to handle %s", type(msg).__name__)

    async def _on_message(self, ident: bytes, msg: object) -> None:
        if isinstance(msg, Register):
            self._register(ident, msg)
            return
        worker = self.registry.get(ident)
        if worker is not None and worker.draining and not worker.alive:
            return  # retired by the planner: it is shutting down, and another takes its cores
        if worker is None or not worker.alive:
            # A worker we dropped (or a router restart): ask it to introduce itself again.
            await self._sock.send_multipart([ident, *self._channel.sign(Hello())])
            return
        worker.last_seen = time.monotonic()
        if isinstance(msg, FlightReply):
            flight = self.flights.get(msg.request_id)
            if flight is not None:
                self.dispatch.on_reply(flight, msg)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("ignoring a %s from worker %s", type(msg).__name__, worker.worker_id)
            return
        result = handler(worker, msg)
        if asyncio.iscoroutine(result):
            await result

    def _register(self, ident: bytes, msg: Register) -> None:
        info = msg.info
        worker = self.registry.join(ident, info, local=self.fleet.owns(info.pid))
        if worker is None:
            return
        if self.info is None:
            self.info = self.dispatch.info = info.core
            sched = self.config.scheduler
            self._make_inputs(sched.max_num_batched_tokens, sched.enable_chunked_prefill)
            self.dispatch.store = StoreView.open(self.config, info.core)
        startup.info("worker %s joined: %s, pid %d on %s, cores %s, %d KV blocks", info.worker_id, info.role, info.pid,
                     info.host, info.cores if info.cores else "any", info.core.num_blocks,
                     extra={"event": "worker_joined", "worker": info.worker_id, "role": info.role})

    async def _on_kv_events(self, worker: WorkerHandle, msg: KVEvents) -> None:
        self.registry.index.apply(worker.worker_id, msg.events)
        if self._kv_pub is not None:
            await self._kv_pub.publish(worker.worker_id, msg)

    async def _on_outputs(self, worker: WorkerHandle, msg: StepOutputs) -> None:
        self.registry.report(worker, msg.stats)
        self._set_stats(self.registry.combined_stats() or self.stats)
        if msg.outputs:
            await self._deliver_outputs(msg.outputs)

    async def _on_failed(self, worker: WorkerHandle, msg: RequestsFailed) -> None:
        await self._abort_in_engine(msg.request_ids)  # stops its routing task and cleans up the other side
        self._fail_children(msg.request_ids, EngineRequestError(msg.message))

    async def _deliver_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            flight = self.flights.get(out.request_id)
            if flight is not None:
                flight.streamed = True
                flight.on_tokens(len(out.new_token_ids))
                if out.finished:
                    self._finished(flight)
        stopped = self._deliver(outputs)
        if stopped:
            await self._abort_in_engine(stopped)

    def _finished(self, flight: Flight) -> None:
        self._drop_flight(flight.request.request_id)
        ttft, tpot = flight.ttft_s, flight.tpot_s(time.monotonic())
        self.dispatch.learn(flight, ttft, tpot)
        record = self.counters.path(flight.path or "unknown")
        record.record(flight.predicted_ttft_s, ttft, flight.predicted_tpot_s, tpot)
        if self.planning is not None and ttft is not None:
            self.planning.observe(ttft, tpot, flight.request.arrival_time, flight.num_output_tokens)

    # -- requests -----------------------------------------------------------------------------
    def _submit(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            flight = Flight(request)
            self.flights[request.request_id] = flight
            if self.planning is not None:
                self.planning.observe_arrival(request.num_prompt_tokens, request.sampling_params.max_tokens)
            self._start_routing(flight)

    def _start_routing(self, flight: Flight) -> None:
        flight.task = asyncio.get_running_loop().create_task(self._route(flight))

    async def _route(self, flight: Flight) -> None:
        rid = flight.request.request_id
        try:
            await self.dispatch.route(flight)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("routing request %s failed", rid)
            self._drop_flight(rid)
            self._fail_children([rid], EngineRequestError(f"routing failed: {type(e).__name__}: {e}"))

    async def _abort_in_engine(self, child_ids: list[str]) -> None:
        for rid in child_ids:
            flight = self._drop_flight(rid)
            if flight is None:
                continue
            if flight.task is not None and flight.task is not asyncio.current_task():
                flight.task.cancel()
            task = asyncio.get_running_loop().create_task(self.dispatch.stop(rid, flight.prefill, flight.decode))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def release_kv(self, handles: list[str]) -> None:
        # The router does not track which worker finished a conversation: each worker drops the
        # handles it holds and ignores the rest.
        if handles:
            for worker in self.registry.live():
                await self._send(worker, ReleaseKV(handles))

    # -- live migration -----------------------------------------------------------------------
    async def migrate_from(self, worker_id: str) -> dict[str, Any]:
        return await self.migrator.migrate_from(worker_id)

    def _fail_request(self, rid: str, message: str) -> None:
        self._drop_flight(rid)
        self._fail_children([rid], EngineRequestError(message))

    def _drop_flight(self, rid: str) -> Flight | None:
        flight = self.flights.pop(rid, None)
        if flight is not None:
            for w in flight.workers():
                w.inflight.discard(rid)
        return flight

    def _active_blocks(self, worker: WorkerHandle) -> int:
        return active_blocks(worker, self.flights, self.info.block_size if self.info is not None else 16)

    # -- failure detection --------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for worker, reason in self.registry.silent_or_exited(self.settings.heartbeat_timeout, self.fleet.exit_code):
                await self._on_worker_death(worker, reason)

    async def _on_worker_death(self, worker: WorkerHandle, reason: str) -> None:
        log.error("%s; serving on with the rest", reason)
        self.registry.drop(worker)
        self.counters.worker_deaths += 1
        for rid in list(worker.inflight):
            flight = self.flights.get(rid)
            if flight is None:
                continue
            if flight.reply is not None and not flight.reply.done():
                flight.reply.set_exception(WorkerLost(reason))  # the routing task retries
            elif flight.phase.streaming and not flight.streamed:
                # Nothing reached the client yet: run it again elsewhere.
                self.dispatch.assign(flight, None, None)
                self._start_routing(flight)
            elif flight.phase.streaming:
                self._drop_flight(rid)
                self._fail_children([rid], EngineRequestError(f"{reason} while serving this request"))
        worker.inflight.clear()
        self.dispatch.on_worker_lost(worker, reason)
        for other in self.registry.live():
            if worker.info.kv_endpoint is not None:
                await self._send(other, Forget(worker.info.kv_endpoint.address))
        restarting = self.restarter.schedule(worker)
        if not self.registry.live() and not restarting:
            self.dead = f"no live workers ({reason})"
            for rid in list(self.streams):
                self._fail(rid, EngineDeadError(self.dead))
        # Else what had not streamed was routed again above, and waits for a worker to join (the one
        # started again, when it was the last): the API answers 503 to new requests meanwhile.
        with contextlib.suppress(Exception):
            self._set_stats(self.registry.combined_stats() or self.stats)
