"""A prefill or decode worker: one engine core behind a DEALER socket connected to the router.

Every worker is a full engine (the router can run a whole request on any of them, which is how it
falls back when a transfer fails); the role decides which KV connector its engine gets
(disagg/connector.py):
  prefill: runs a request with the TransferHandle it came with, ships its KV layer by layer as it
           computes, and reports the first token once the transfer has landed;
  decode:  owns the pool the KV lands in; a reserved request waits for its KV in the engine (its
           blocks allocated and opened for writes), and decodes once the router says it landed.

Router -> worker (signed, see wire.py):
  ("add", [Request]) ("abort", [request_id]) ("reserve", Request) ("prefill", Request, TransferHandle)
  ("admit", request_id, first_token, generator_state) ("forget", kv_address) ("shutdown",) ("hello",)
Worker -> router:
  ("register", WorkerInfo) ("outputs", [EngineCoreOutput], WorkerStats) ("kv_events", [BlockStored | BlockRemoved])
  ("reserved", request_id, TransferHandle) ("reserve_failed", request_id, reason)
  ("prefilled", request_id, EngineCoreOutput, generator_state, TransferResult | None)
  ("transfer_failed", request_id, reason) ("failed", [request_id], reason) ("aborted", [request_id])
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass, replace

import zmq

from tandem.config import EngineConfig
from tandem.disagg import secure, wire
from tandem.disagg.connector import KVRecvConnector, KVSendConnector
from tandem.disagg.transport import KVEndpoint, KVReceiver, RoutingSender, TransferStats, make_receiver
from tandem.engine.kv_connector import KVConnector
from tandem.engine.request import Request
from tandem.serve.core_proc import IDLE_POLL_MS, CoreInfo, CoreStats, core_info, core_stats, send_failures

log = logging.getLogger(__name__)

RESERVATION_TTL_S = 120.0  # a reservation nobody admitted or released by then is taken back


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    core: CoreInfo
    kv_endpoint: KVEndpoint | None
    host: str
    pid: int
    cores: list[int] | None


@dataclass
class WorkerStats:
    core: CoreStats
    transfer: TransferStats


def pin_cores(cores: list[int] | None) -> int:
    """Pin this process to cores (when given) and return how many threads to run."""
    if cores:
        os.sched_setaffinity(0, cores)
        return len(cores)
    return len(os.sched_getaffinity(0))


class Worker:
    def __init__(self, config: EngineConfig, role: str, router_addr: str, secret: bytes, worker_id: str,
                 cores: list[int] | None, kv_transport: str, kv_host: str) -> None:
        from tandem.engine.core import EngineCore
        from tandem.model.loader import load_model

        self.role, self.secret, self.worker_id, self.cores = role, secret, worker_id, cores
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        secure.client(self.sock, secret, router_addr, wire.MAX_CONTROL_FRAME)
        self.sock.connect(router_addr)
        self.channel = wire.Channel(secret)
        self.receiver: KVReceiver | None = None
        self.sender = RoutingSender(secret)
        block_size = config.cache.block_size
        self.kv_send = KVSendConnector(self.sender, block_size)
        self.kv_recv: KVRecvConnector | None = None
        connector: KVConnector = self.kv_send
        if role == "decode":
            self.receiver = make_receiver(kv_transport, kv_host, 0, secret)
            connector = self.kv_recv = KVRecvConnector(self.receiver, block_size, worker_id)
        config.cache.enable_kv_events = True  # the router's prefix index follows this pool
        loaded = load_model(config.model.model, config.model.dtype, config.model.device)
        self.core = EngineCore(config, loaded.model, self.receiver.allocate_pool if self.receiver else None, connector)
        self.info = core_info(self.core, loaded)
        self.transfer = TransferStats()
        self.prefills: dict[str, Request] = {}  # prefill requests running here, by id
        self.landing: dict[str, tuple] = {}  # sampled, KV in flight: request id -> (output, generator state)
        self.reserved_at: dict[str, float] = {}
        self.parent_pid: int | None = None  # a worker the router started goes when the router goes

    def send(self, *msg: object) -> None:
        self.sock.send_multipart(self.channel.sign(msg))

    def register(self) -> None:
        self.send("register", WorkerInfo(self.worker_id, self.role, self.info,
                                         self.receiver.endpoint if self.receiver else None, socket.gethostname(),
                                         os.getpid(), self.cores))

    def stats(self) -> WorkerStats:
        if self.receiver is not None:
            self.transfer.bytes_received = self.receiver.bytes_received
        return WorkerStats(core_stats(self.core), replace(self.transfer))

    # -- messages -----------------------------------------------------------------------------
    def handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "shutdown":
            return False
        if kind == "add":
            for request in msg[1]:
                self.add(request)
        elif kind == "abort":
            self.abort(msg[1])
            self.send("aborted", msg[1])  # the router frees the matching reservations only after this
        elif kind == "forget":
            self.sender.forget(msg[1])
        elif kind == "reserve":
            self.reserve(msg[1])
        elif kind == "prefill":
            _, request, handle = msg
            self.kv_send.send_to(handle)
            if self.add(request):
                self.prefills[request.request_id] = request
            else:
                self.kv_send.forget(request.request_id)
        elif kind == "admit":
            _, rid, first_token, generator_state = msg
            self.reserved_at.pop(rid, None)
            if self.kv_recv is None or not self.kv_recv.arrived(rid, first_token, generator_state):
                self.send("failed", [rid], "the decode worker no longer holds this request's KV")
        elif kind == "hello":
            self.register()
        return True

    def add(self, request: Request) -> bool:
        try:
            self.core.add_request(request)
            return True
        except ValueError as e:  # e.g. an id still in use here: fail the request, not the worker
            self.send("failed", [request.request_id], str(e))
            return False

    def reserve(self, request: Request) -> None:
        """Queue the request as one whose prompt KV arrives from outside; it is "reserved" once the
        engine has allocated its blocks (at once, or when blocks free up: the router waits)."""
        if self.kv_recv is None:
            self.transfer.reservations_refused += 1
            self.send("reserve_failed", request.request_id, f"worker {self.worker_id} is not a decode worker")
            return
        self.kv_recv.expect(request.request_id)
        try:
            self.core.add_request(request)
        except ValueError as e:
            self.send("reserve_failed", request.request_id, str(e))

    def report_reservations(self) -> None:
        if self.kv_recv is None:
            return
        for handle in self.kv_recv.take_reserved():
            self.reserved_at[handle.request_id] = time.monotonic()
            self.transfer.reservations += 1
            self.send("reserved", handle.request_id, handle)

    def abort(self, request_ids: list[str]) -> None:
        """The engine's connectors close reservations and stop transfers before any block is freed."""
        for rid in request_ids:
            self.reserved_at.pop(rid, None)
            self.prefills.pop(rid, None)
            self.landing.pop(rid, None)
        self.core.abort(request_ids)
        for rid in request_ids:
            self.kv_send.forget(rid)  # a handle for a request that never reached the engine

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as e:
            log.error("engine step failed: %s", traceback.format_exc())
            failed = list(self.core.scheduler.requests)
            self.abort(failed)
            self.send("failed", failed, f"engine error: {type(e).__name__}: {e}")
            return
        outputs = send_failures(outputs, self._report_failure)
        plain = []
        for out in outputs:
            request = self.prefills.get(out.request_id)
            if request is None:
                plain.append(out)
                continue
            del self.prefills[out.request_id]
            # It ran with max_tokens 1: finished, and its connector finished the transfer; the router
            # hears of the token once the KV has landed.
            state = request.generator.get_state() if request.generator is not None else None
            self.landing[out.request_id] = (out, state)
        self.report_reservations()
        events = self.core.scheduler.kv.pool.take_events()
        if events:
            self.send("kv_events", events)
        if plain or not outputs:
            self.send("outputs", plain, self.stats())

    def _report_failure(self, request_ids: list[str], message: str) -> None:
        self.abort(request_ids)  # forget its transfer state; the engine has freed its blocks
        self.send("failed", request_ids, message)

    def collect_transfers(self) -> None:
        for result in self.sender.poll():
            self.transfer.add(result)
            landed = self.landing.pop(result.request_id, None)
            if landed is None:
                continue  # aborted meanwhile
            if result.ok:
                self.send("prefilled", result.request_id, landed[0], landed[1], result)
            else:
                self.send("transfer_failed", result.request_id, result.error)

    def expire_reservations(self) -> None:
        now = time.monotonic()
        stale = [rid for rid, t in self.reserved_at.items() if now - t > RESERVATION_TTL_S]
        if stale:
            log.warning("taking back %d reservations nobody admitted", len(stale))
            self.abort(stale)

    def run(self) -> None:
        self.register()
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        last_beat = 0.0
        while True:
            busy = self.core.has_unfinished() or bool(self.landing)
            events = dict(poller.poll(0 if self.core.has_unfinished() else (5 if self.landing else IDLE_POLL_MS)))
            while events.get(self.sock):
                try:
                    msg, _ = self.channel.verify(self.sock.recv_multipart())
                except wire.AuthError as e:
                    log.warning("dropped a message from the router: %s", e)
                else:
                    try:
                        if not self.handle(msg):
                            return
                    except Exception:  # one bad message must not take the worker's other requests down
                        log.exception("failed to handle %s", msg[0])
                events = dict(poller.poll(0))
            if self.core.has_unfinished():
                self.step()
            self.collect_transfers()
            now = time.monotonic()
            if not busy and now - last_beat >= IDLE_POLL_MS / 1000:
                self.send("outputs", [], self.stats())  # heartbeat with fresh stats
                last_beat = now
                if self.parent_pid is not None and os.getppid() != self.parent_pid:
                    log.error("the router that started this worker is gone; exiting")
                    return
            self.expire_reservations()

    def close(self) -> None:
        self.abort(list(self.core.scheduler.requests))
        self.core.close()
        self.sender.close()
        if self.receiver is not None:
            self.receiver.shutdown()
        self.sock.close(linger=500)


def _exit_cleanly(*_: object) -> None:
    raise SystemExit(0)


def run_worker(config: EngineConfig, role: str, router_addr: str, secret: bytes, worker_id: str,
               cores: list[int] | None, kv_transport: str, kv_host: str, parent_pid: int | None = None) -> int:
    num_cores = pin_cores(cores)
    if cores:  # a worker pinned to n cores runs n threads: more would only fight over them
        config.parallel.num_threads = num_cores
    signal.signal(signal.SIGTERM, _exit_cleanly)
    worker = Worker(config, role, router_addr, secret, worker_id, cores, kv_transport, kv_host)
    worker.parent_pid = parent_pid
    try:
        worker.run()
    finally:
        worker.close()
    return 0
