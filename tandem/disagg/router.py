"""The router: the disaggregated deployment's engine client, behind the same HTTP API.

Per engine request (a child, when n > 1) a routing task runs the flow:
  0. a prompt the KV store holds goes whole to a decode worker, and one with little left to prefill
     (or any, when there are only colocated workers) goes whole to one worker: routing.py picks it;
  1. pick a prefill and a decode worker (routing.py: where the prefix is cached, against the load);
  2. ask the decode worker to reserve blocks for the prompt -> a TransferHandle (retried while it
     has no room, up to reserve_timeout);
  3. send the request to the prefill worker with the handle; it computes the prompt, ships the KV
     layer by layer and answers with the first token once the KV has landed;
  4. deliver that token and tell the decode worker to admit the request; its tokens stream back.
Every wait has a timeout. A failed transfer releases the reservation and the request is retried on
another pair, or run whole on one worker (colocated) when no pair is left. A worker that stops
heart-beating, or whose process exits, is dropped: its requests that have not streamed a token are
retried, the others fail with a clear error, and routing goes on with the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import time
from dataclasses import replace
from typing import Any

import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.disagg import secure, wire
from tandem.disagg.flight import Flight, RouterCounters, RouterSettings, WorkerLost, first_token_output, prefill_request
from tandem.disagg.metrics import DisaggMetrics
from tandem.disagg.planner import PlannerSettings
from tandem.disagg.planning import PlannerLoop
from tandem.disagg.prefix_index import PrefixIndex
from tandem.disagg.registry import WorkerHandle, combined_stats
from tandem.disagg.restarts import Restarter
from tandem.disagg.routing import Pick, Router, RoutingSettings
from tandem.disagg.store_view import StoreView
from tandem.disagg.transport import TransferHandle
from tandem.disagg.worker import WorkerInfo
from tandem.engine.core import EngineCoreOutput
from tandem.engine.request import Request
from tandem.kv.hashing import block_keys
from tandem.serve.async_engine import EngineClient, EngineDeadError, EngineRequestError
from tandem.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)

REFUSED_PEERS = 1024  # peers whose refusal was logged; an identity is chosen by the peer, so bound them


class DisaggEngine(EngineClient):
    def __init__(self, config: EngineConfig, tokenizer: Any | None, settings: RouterSettings,
                 launch: Any = None,  # callable(router_address) -> list[Popen] for local workers
                 routing: RoutingSettings | None = None, planner: PlannerSettings | None = None) -> None:
        super().__init__(tokenizer)
        self.config = config
        self.settings = settings
        routing = routing or RoutingSettings()
        self.index = PrefixIndex(routing.predict_ttl_s)
        self.router = Router(routing, self.index, self._active_blocks)
        self.planning = PlannerLoop(self, planner) if planner is not None and planner.enabled else None
        self.launch = launch
        self.workers: dict[bytes, WorkerHandle] = {}
        self.flights: dict[str, Flight] = {}
        self.counters = RouterCounters()
        self.address = ""
        self._procs: list[subprocess.Popen] = []
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished worker raises, not drops
        secure.server(self._sock, settings.secret, settings.bind, wire.MAX_CONTROL_FRAME)
        self._channel = wire.Channel(settings.secret)
        self._tasks: list[asyncio.Task] = []
        self._abort_acks: dict[str, tuple[asyncio.Future, WorkerHandle]] = {}
        self._background: set[asyncio.Task] = set()
        self.restarter = Restarter(getattr(launch, "start", None), settings.restart_backoff_s,
                                   settings.max_restart_backoff_s)
        self._refused: wire.LRU[bytes, None] = wire.LRU(REFUSED_PEERS)
        self.store: StoreView | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        bind = self.settings.bind
        if bind.startswith("tcp://") and bind.endswith(":0"):
            port = self._sock.bind_to_random_port(bind.rsplit(":", 1)[0])
            self.address = f"{bind.rsplit(':', 1)[0]}:{port}"
        else:
            self._sock.bind(bind)
            self.address = bind
        log.warning("router listening on %s for workers", self.address)
        if self.launch is not None:
            self._procs = list(self.launch(self.address))
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]
        if self.planning is not None:
            self._tasks.append(asyncio.create_task(self.planning.run()))
        try:
            await self._wait_for_workers()
        except BaseException:
            for p in self._procs:  # leave no orphan behind a failed start
                p.kill()
            raise

    async def _wait_for_workers(self) -> None:
        deadline = time.monotonic() + self.settings.startup_timeout
        # At least one: the API needs a worker's model limits before it can validate anything.
        while sum(w.alive for w in self.workers.values()) < max(self.settings.expected_workers, 1):
            if any(p.poll() is not None for p in self._procs):
                codes = [p.poll() for p in self._procs]
                raise RuntimeError(f"a worker exited during start-up (exit codes {codes})")
            if time.monotonic() > deadline:
                raise RuntimeError("workers did not register in time")
            await asyncio.sleep(0.1)

    async def shutdown(self) -> None:
        self.restarter.stop()
        for rid in list(self.streams):
            self._fail(rid, EngineDeadError("server shutting down"))
        for w in self.workers.values():
            if w.alive:
                await self._send(w, "shutdown")
        for task in self._tasks:
            task.cancel()
        loop = asyncio.get_running_loop()
        for p in self._procs:
            try:
                await loop.run_in_executor(None, p.wait, 10)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.store is not None:
            self.store.close()
        secure.release(self._sock)
        self._sock.close(linger=0)
        self._ctx.term()

    def attach_metrics(self, metrics: ServerMetrics) -> None:
        exporter = DisaggMetrics(metrics.registry, metrics.model_name)
        metrics.collectors.append(lambda: exporter.collect(self))

    @property
    def healthy(self) -> bool:
        return self.dead is None and any(w.alive for w in self.workers.values())

    def capacity(self) -> int:
        """Sequences the deployment runs at once: its decode workers' (every live worker's without)."""
        serving = self.live("decode") or self.live()
        return sum(w.info.core.max_num_seqs for w in serving) or 1

    def live(self, role: str | None = None) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def routable(self, role: str | None = None) -> list[WorkerHandle]:
        """Live workers that take new requests (not being drained by the planner)."""
        return [w for w in self.live(role) if not w.draining]

    # -- messaging ----------------------------------------------------------------------------
    async def _send(self, worker: WorkerHandle, *msg: object) -> bool:
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
                log.exception("router failed to handle %s", msg[0])

    async def _on_message(self, ident: bytes, msg: tuple) -> None:
        kind = msg[0]
        if kind == "register":
            self._register(ident, msg[1])
            return
        worker = self.workers.get(ident)
        if worker is not None and worker.draining and not worker.alive:
            return  # retired by the planner: it is shutting down, and another takes its cores
        if worker is None or not worker.alive:
            # A worker we dropped (or a router restart): ask it to introduce itself again.
            await self._sock.send_multipart([ident, *self._channel.sign(("hello",))])
            return
        worker.last_seen = time.monotonic()
        if kind == "outputs":
            _, outputs, worker.stats = msg
            self._refresh_stats()
            if outputs:
                await self._deliver_outputs(outputs)
        elif kind == "kv_events":
            self.index.apply(worker.worker_id, msg[1])
        elif kind in ("reserved", "reserve_failed", "prefilled", "transfer_failed"):
            flight = self.flights.get(msg[1])
            if flight is not None and flight.reply is not None and not flight.reply.done():
                flight.reply.set_result(msg)
        elif kind == "aborted":
            for rid in msg[1]:
                ack = self._abort_acks.get(rid)
                if ack is not None and not ack[0].done():
                    ack[0].set_result(None)
        elif kind == "failed":
            _, child_ids, message = msg
            await self._abort_in_engine(child_ids)  # stops its routing task and cleans up the other side
            self._fail_children(child_ids, EngineRequestError(message))

    def _register(self, ident: bytes, info: WorkerInfo) -> None:
        old = self.workers.get(ident)
        if old is not None and old.alive:
            old.info = info
            return
        worker = WorkerHandle(info, ident)
        self.index.forget(info.worker_id)  # a new or restarted worker: its pool is empty
        for p in self._procs:
            if p.pid == info.pid:
                worker.proc = p
        self.workers[ident] = worker
        if self.info is None:
            self.info = info.core
            sched = self.config.scheduler
            self._make_inputs(sched.max_num_batched_tokens, sched.enable_chunked_prefill)
            self.store = StoreView.open(self.config, info.core)
        log.warning("worker %s (%s, pid %d on %s, cores %s) joined", info.worker_id, info.role, info.pid, info.host,
                    info.cores)

    def _refresh_stats(self) -> None:
        self._set_stats(combined_stats(self.live()) or self.stats)

    async def _deliver_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            flight = self.flights.get(out.request_id)
            if flight is not None:
                flight.streamed = True
                if self.planning is not None:
                    self.planning.on_output(flight, len(out.new_token_ids), out.finished)
                if out.finished:
                    self._drop_flight(out.request_id)
        stopped = self._deliver(outputs)
        if stopped:
            await self._abort_in_engine(stopped)

    # -- requests -----------------------------------------------------------------------------
    def _submit(self, requests: list[Request]) -> None:
        for request in requests:
            flight = Flight(request)
            self.flights[request.request_id] = flight
            flight.task = asyncio.get_running_loop().create_task(self._route(flight))

    async def _abort_in_engine(self, child_ids: list[str]) -> None:
        for rid in child_ids:
            flight = self._drop_flight(rid)
            if flight is None:
                continue
            if flight.task is not None and flight.task is not asyncio.current_task():
                flight.task.cancel()
            task = asyncio.get_running_loop().create_task(self._stop(rid, flight.prefill, flight.decode))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    def _drop_flight(self, rid: str) -> Flight | None:
        flight = self.flights.pop(rid, None)
        if flight is not None:
            for w in flight.workers():
                w.inflight.discard(rid)
        return flight

    def _assign(self, flight: Flight, prefill: WorkerHandle | None, decode: WorkerHandle | None) -> None:
        for w in flight.workers():
            w.inflight.discard(flight.request.request_id)
        flight.prefill, flight.decode = prefill, decode
        for w in flight.workers():
            w.inflight.add(flight.request.request_id)

    async def _ask(self, flight: Flight, worker: WorkerHandle, timeout: float, *msg: object) -> tuple:
        """Send msg and wait for the worker's reply about this request."""
        flight.reply = asyncio.get_running_loop().create_future()
        if not await self._send(worker, *msg):
            raise WorkerLost(f"worker {worker.worker_id} is unreachable")
        try:
            return await asyncio.wait_for(flight.reply, timeout)
        finally:
            flight.reply = None

    def _active_blocks(self, worker: WorkerHandle) -> int:
        """The KV blocks of the requests the worker is serving: its decode load, as the router sees it."""
        bs = self.info.block_size if self.info is not None else 16
        return sum(-(-self.flights[r].request.num_tokens // bs) for r in worker.inflight if r in self.flights)

    def _pick(self, flight: Flight, workers: list[WorkerHandle], path: str) -> Pick | None:
        pick = self.router.pick(flight.keys, flight.num_blocks, workers)
        if pick is not None:
            self.router.routed(pick, flight.keys)
            self.counters.count_route(path, pick.worker.worker_id, pick.overlap_blocks, len(flight.keys))
        return pick

    def _runs_whole(self, flight: Flight) -> list[WorkerHandle]:
        """The workers to run this request on whole (no transfer), or [] to disaggregate it."""
        colocated, decode = self.routable("colocated"), self.routable("decode")
        if not (self.routable("prefill") and decode):
            return colocated  # no pair: colocated workers (or, if none, the fallback below)
        limit = self.settings.max_local_prefill_tokens
        candidates = colocated or decode
        if limit <= 0 or not candidates:
            return []
        bs = self.info.block_size if self.info is not None else 16
        best = max(self.index.overlap(w.worker_id, flight.keys) for w in candidates)
        return candidates if flight.request.num_prompt_tokens - best * bs <= limit else []

    async def _route(self, flight: Flight) -> None:
        rid = flight.request.request_id
        try:
            if self.info is not None and not flight.keys:
                flight.keys = block_keys(flight.request.prompt_token_ids, self.info.block_size, self.info.hash_algo,
                                         self.info.block_key_extra, flight.request.cache_salt)
                flight.num_blocks = -(-flight.request.num_prompt_tokens // self.info.block_size)
            if self.store is not None and self.routable("decode") and self.store.prefill_free(flight.request):
                self.counters.prefill_free += 1
                await self._run_colocated(flight, self._pick(flight, self.routable("decode"), "prefill-free"))
                return
            whole = self._runs_whole(flight)
            if whole:
                await self._run_colocated(flight, self._pick(flight, whole, "colocated"))
                return
            for attempt in range(self.settings.max_attempts):
                if attempt:
                    self.counters.retries += 1
                prefill = self._pick(flight, self.routable("prefill"), "disaggregated")
                decode = self.router.pick(flight.keys, flight.num_blocks, self.routable("decode"))
                if prefill is None or decode is None:
                    break
                self.router.routed(decode, flight.keys)
                try:
                    if await self._run_disaggregated(flight, prefill.worker, decode.worker):
                        return
                except (WorkerLost, TimeoutError) as e:
                    log.warning("request %s: %s; retrying", rid, e or type(e).__name__)
                await self._release(flight)
            await self._run_colocated(flight, fallback=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("routing request %s failed", rid)
            self._drop_flight(rid)
            self._fail_children([rid], EngineRequestError(f"routing failed: {type(e).__name__}: {e}"))

    async def _run_disaggregated(self, flight: Flight, prefill: WorkerHandle, decode: WorkerHandle) -> bool:
        """True when the request is decoding (or done); False to try something else."""
        rid = flight.request.request_id
        self._assign(flight, prefill, decode)
        flight.phase = "reserve"
        t0 = time.monotonic()
        while True:
            reply = await self._ask(flight, decode, self.settings.reserve_timeout, "reserve", flight.request)
            if reply[0] == "reserved":
                break
            if time.monotonic() - t0 > self.settings.reserve_timeout:
                log.warning("request %s: decode worker %s had no room for %.1f s", rid, decode.worker_id,
                            self.settings.reserve_timeout)
                self._assign(flight, None, None)
                return False
            await asyncio.sleep(0.05)  # blocks free up as other requests finish
        self.counters.reserve_wait_s.append(time.monotonic() - t0)
        handle: TransferHandle = reply[2]
        flight.phase = "prefill"
        reply = await self._ask(flight, prefill, self.settings.prefill_timeout, "prefill",
                                prefill_request(flight.request), handle)
        if reply[0] == "transfer_failed":
            log.warning("request %s: KV transfer %s -> %s failed: %s", rid, prefill.worker_id, decode.worker_id,
                        reply[2])
            return False
        first: EngineCoreOutput = reply[2]
        generator_state = reply[3]
        self.counters.disaggregated += 1
        self._assign(flight, None, decode)
        first = first_token_output(flight.request, first, self.info.max_model_len if self.info else 1 << 62)
        if first.finished:  # the first token ended it: the reservation is not needed
            await self._send(decode, "abort", [rid])
        else:
            flight.phase = "decode"
            await self._send(decode, "admit", rid, first.new_token_ids[0], generator_state)
        await self._deliver_outputs([first])
        return True

    async def _release(self, flight: Flight) -> None:
        """Undo a failed attempt before the next one (which reuses the request id)."""
        prefill, decode = flight.prefill, flight.decode
        self._assign(flight, None, None)
        await self._stop(flight.request.request_id, prefill, decode)

    async def _stop(self, rid: str, prefill: WorkerHandle | None, decode: WorkerHandle | None) -> None:
        """Abort on both sides. The decode worker's reserved blocks go back to its pool only after
        the prefill worker confirms it stopped, so no late write can land in blocks that were
        already given to another request."""
        if prefill is not None and prefill.alive:
            ack = asyncio.get_running_loop().create_future()
            self._abort_acks[rid] = (ack, prefill)
            try:
                if await self._send(prefill, "abort", [rid]):
                    await asyncio.wait_for(ack, self.settings.heartbeat_timeout)
            except (TimeoutError, WorkerLost):
                pass  # not confirmed: the worker is dead or about to be declared so
            finally:
                self._abort_acks.pop(rid, None)
        if decode is not None and decode is not prefill and decode.alive:
            await self._send(decode, "abort", [rid])

    async def _run_colocated(self, flight: Flight, pick: Pick | None = None, fallback: bool = False) -> None:
        """The whole request on one worker: the one picked (a colocated worker; a decode worker that
        loads the prompt from the store or prefills a short one), or, as a fallback when no pair can
        take it, the least-loaded decode (else any) worker."""
        worker = pick.worker if pick is not None else None
        if worker is None:
            candidates = self.routable("colocated") or self.routable("decode") or self.routable() or self.live()
            if not candidates:
                raise EngineDeadError("no live worker to serve the request")
            worker = min(candidates, key=lambda w: (w.load, w.worker_id))
        self.counters.fallbacks += fallback
        self.counters.colocated += 1
        self._assign(flight, None, worker)
        flight.phase = "colocated"
        # A fresh copy: the request object may have been sent before and must start clean.
        if not await self._send(worker, "add", [replace(flight.request)]):
            raise WorkerLost(f"worker {worker.worker_id} is unreachable")

    def health(self) -> dict[str, Any]:
        """ok, degraded (a role has no live worker: requests still run, colocated) or unhealthy."""
        reasons = [f"no live {role} worker" for role in sorted({w.role for w in self.workers.values()})
                   if not self.live(role)]
        if not self.healthy:
            return {"status": "unhealthy", "reasons": reasons or [self.dead or "no live workers"]}
        return {"status": "degraded" if reasons else "ok", "reasons": reasons}

    # -- failure detection --------------------------------------------------------------------
    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if not w.alive:
                    continue
                exited = w.proc is not None and w.proc.poll() is not None
                silent = now - w.last_seen > self.settings.heartbeat_timeout
                if exited or silent:
                    reason = (f"worker {w.worker_id} exited (code {w.proc.poll()})" if exited and w.proc
                              else f"worker {w.worker_id} stopped responding")
                    await self._on_worker_death(w, reason)

    async def _on_worker_death(self, worker: WorkerHandle, reason: str) -> None:
        log.error("%s; serving on with the rest", reason)
        worker.alive = False
        self.index.forget(worker.worker_id)
        self.counters.worker_deaths += 1
        for rid in list(worker.inflight):
            flight = self.flights.get(rid)
            if flight is None:
                continue
            if flight.reply is not None and not flight.reply.done():
                flight.reply.set_exception(WorkerLost(reason))  # the routing task retries
            elif flight.phase in ("decode", "colocated") and not flight.streamed:
                # Nothing reached the client yet: run it again elsewhere.
                self._assign(flight, None, None)
                flight.task = asyncio.get_running_loop().create_task(self._route(flight))
            elif flight.phase in ("decode", "colocated"):
                self._drop_flight(rid)
                self._fail_children([rid], EngineRequestError(f"{reason} while serving this request"))
        worker.inflight.clear()
        for ack, prefill in list(self._abort_acks.values()):
            if prefill is worker and not ack.done():
                ack.set_exception(WorkerLost(reason))  # a dead worker writes nothing more
        for other in self.live():
            if worker.info.kv_endpoint is not None:
                await self._send(other, "forget", worker.info.kv_endpoint.address)
        restarting = self.restarter.schedule(worker, self.address, self._procs)
        if not self.live():
            if not restarting:
                self.dead = f"no live workers ({reason})"
            for rid in list(self.streams):
                self._fail(rid, EngineDeadError(f"no live workers ({reason})"))
        with contextlib.suppress(Exception):
            self._refresh_stats()
