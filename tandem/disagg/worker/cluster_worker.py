"""A cluster worker: one engine core behind a DEALER socket connected to the router, running the
same engine service loop as the colocated server's core (engine/service.py).

Every worker is a full engine (the router can run a whole request on any of them, which is how it
runs short prompts and falls back when a transfer fails); the role decides which KV connector its
engine gets (disagg/worker/kv_connectors.py):
  prefill, colocated: run a Prefill with the TransferHandle it came with, shipping its KV layer by
           layer as they compute, and report the first token once the transfer has landed;
  decode:  owns the pool the KV lands in; a reserved request waits for its KV in the engine (its
           blocks allocated and opened for writes), and decodes once the router says it landed.
Decode and colocated workers both receive (a colocated worker's pool is a landing place too), so
either can take a decoding request another worker hands over in a live migration; any worker
that decodes can hand one over (Pause, MigrateKV, Resume).
Messages: disagg/worker/messages.py.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import replace

import zmq

from tandem.config import EngineConfig
from tandem.disagg.worker import secure, wire
from tandem.disagg.worker.kv_connectors import KVRecvConnector, KVSendConnector
from tandem.disagg.worker.messages import (
    RECEIVING_ROLES,
    Aborted,
    Admit,
    Alive,
    Forget,
    Hello,
    Migrated,
    MigrateKV,
    Pause,
    Paused,
    Prefill,
    Prefilled,
    Register,
    Reserve,
    Reserved,
    ReserveFailed,
    Resume,
    TransferFailed,
    WorkerInfo,
    WorkerStats,
)
from tandem.disagg.worker.transport import KVReceiver, TransferResult, TransferStats
from tandem.disagg.worker.transports.factory import RoutingSender, make_receiver
from tandem.engine.connectors.base import KVConnector
from tandem.engine.connectors.multi import MultiConnector
from tandem.engine.core import EngineCore
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_report import core_info, core_stats
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import AbortRequests, RequestsFailed
from tandem.engine.request import Request
from tandem.engine.service import HEARTBEAT_S, EngineService
from tandem.logs import startup

log = logging.getLogger(__name__)

RESERVATION_TTL_S = 120.0  # a reservation nobody admitted or released by then is taken back
ALIVE_S = 1.0  # the heartbeat thread speaks up when the worker has sent nothing for this long


def pin_cores(cores: list[int] | None) -> int:
    """Pin this process to cores (when given) and return how many threads to run."""
    if cores:
        os.sched_setaffinity(0, cores)
        return len(cores)
    return len(os.sched_getaffinity(0))


class Worker(EngineService):
    def __init__(self, config: EngineConfig, role: str, router_addr: str, secret: bytes, worker_id: str,
                 cores: list[int] | None, kv_transport: str, kv_host: str, profile_speed: bool = False) -> None:
        from tandem.engine.worker_group import load_engine_model

        self.role, self.worker_id, self.cores = role, worker_id, cores
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        secure.client(self.sock, secret, router_addr, wire.MAX_CONTROL_FRAME)
        self.sock.connect(router_addr)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.channel = wire.Channel(secret)
        # One step can outlast the router's heartbeat timeout (a long prompt chunk on one core takes
        # seconds), so a thread says Alive meanwhile. It shares the socket: every use of the socket
        # and of the channel's counter holds this lock (a full barrier, as ZeroMQ requires).
        self._sock_lock = threading.Lock()
        self._last_sent = time.monotonic()
        self._alive_stop = threading.Event()
        self._alive = threading.Thread(target=self._say_alive, name="worker-alive", daemon=True)
        self.receiver: KVReceiver | None = None
        self.sender = RoutingSender(secret)
        block_size = config.cache.block_size
        self.kv_send = KVSendConnector(self.sender, block_size)
        self.kv_recv: KVRecvConnector | None = None
        # Every worker sends: a prefill's KV, or a paused request's on a live migration (a decode worker's).
        connector: KVConnector = self.kv_send
        if role in RECEIVING_ROLES and kv_transport != "none":  # none: nobody sends it KV (a lone worker)
            self.receiver = make_receiver(kv_transport, kv_host, 0, secret)
            self.kv_recv = KVRecvConnector(self.receiver, block_size, worker_id)
            connector = MultiConnector([self.kv_send, self.kv_recv])
        config.cache.enable_kv_events = True  # the router's prefix index follows this pool
        loaded = load_engine_model(config)
        super().__init__(EngineCore(config, loaded.model, connector, lambda: loaded.tokenizer,
                                    shared_kv=self.receiver is not None and self.receiver.needs_shared_pool))
        self.handlers.update({
            AbortRequests: self._on_abort, Forget: lambda m: self.sender.forget(m.kv_address),
            Reserve: lambda m: self.reserve(m.request), Prefill: self._on_prefill, Admit: self._on_admit,
            Hello: lambda m: self.register(),
            Pause: self._on_pause, MigrateKV: self._on_migrate, Resume: lambda m: self.core.resume(m.request_id),
        })
        # Its step times, as the single server's core times them: the router's admission predicts a lone
        # worker from them (registry.py shape; several are predicted from measured rates, so they are
        # not timed). Kept per machine and settings (step_time_cache.py).
        if profile_speed:
            self.core.profile_speed()
        self.info = WorkerInfo(worker_id, role, core_info(self.core, loaded),
                               self.receiver.endpoint if self.receiver else None, socket.gethostname(), os.getpid(),
                               cores)
        self.transfer = TransferStats()
        self.prefills: dict[str, EngineCoreRequest] = {}  # prefill requests running here, by id
        self.landing: dict[str, EngineCoreOutput] = {}  # sampled, KV in flight: request id -> its output
        self.reserved_at: dict[str, float] = {}
        self.migrating: set[str] = set()  # paused here, KV on its way to another worker
        self.parent_pid: int | None = None  # a worker the router started goes when the router goes
        self._last_parent_check = 0.0

    # -- the engine service's transport ---------------------------------------------------------
    def receive(self, timeout_s: float) -> list[object]:
        msgs: list[object] = []
        while True:
            with self._sock_lock:
                if not self.poller.poll(0 if msgs else int(timeout_s * 1000)):
                    return msgs
                frames = self.sock.recv_multipart()
            try:
                msg, _ = self.channel.verify(frames)
            except wire.AuthError as e:
                log.warning("dropped a message from the router: %s", e)
                continue
            msgs.append(msg)

    def send(self, msg: object) -> None:
        with self._sock_lock:
            self.sock.send_multipart(self.channel.sign(msg))
            self._last_sent = time.monotonic()

    def run(self) -> None:
        self._alive.start()
        super().run()

    def _say_alive(self) -> None:
        while not self._alive_stop.wait(ALIVE_S / 2):
            if time.monotonic() - self._last_sent >= ALIVE_S:
                try:
                    self.send(Alive())
                except zmq.ZMQError:  # the socket is closing
                    return

    def register(self) -> None:
        self.send(Register(self.info))

    def stats(self) -> WorkerStats:
        if self.receiver is not None:
            self.transfer.bytes_received = self.receiver.bytes_received
        return WorkerStats(core_stats(self.core), replace(self.transfer))

    # -- messages -----------------------------------------------------------------------------
    def _on_abort(self, msg: AbortRequests) -> None:
        self.abort(msg.request_ids)
        self.send(Aborted(msg.request_ids))  # the router frees the matching reservations only after this

    def _on_prefill(self, msg: Prefill) -> None:
        self.kv_send.send_to(msg.handle)
        if self.add(msg.request):
            self.prefills[msg.request.request_id] = msg.request
        else:
            self.kv_send.forget(msg.request.request_id)

    def _on_admit(self, msg: Admit) -> None:
        self.reserved_at.pop(msg.request_id, None)
        if self.kv_recv is None or not self.kv_recv.arrived(msg.request_id, msg.first_token):
            self.send(RequestsFailed([msg.request_id], "the decode worker no longer holds this request's KV"))

    def _on_pause(self, msg: Pause) -> None:
        request = self.core.pause(msg.request_id)
        if request is None:
            self.send(Paused(msg.request_id, None, f"request {msg.request_id} is not decoding on {self.worker_id}"))
        else:
            self.send(Paused(msg.request_id, list(request.output_token_ids)))

    def _on_migrate(self, msg: MigrateKV) -> None:
        """Ship the paused request's computed blocks past what the target caches, every layer, then
        fence: the request goes once the sender says they landed (_collect_transfers)."""
        rid, handle = msg.request_id, msg.handle
        request = self.core.scheduler.paused.get(rid)
        if request is None:
            self.send(Migrated(rid, False, reason=f"request {rid} is not paused on {self.worker_id}"))
            return
        refused = self.kv_send.migrate(handle, self.core.scheduler.kv.get_block_ids(rid), request.num_computed_tokens)
        if refused is not None:
            self.send(Migrated(rid, False, reason=refused))
            return
        self.migrating.add(rid)
        self._collect_transfers()  # a synchronous transport (shm) has landed already: answer now, not after a step

    def reserve(self, request: EngineCoreRequest) -> None:
        """Queue the request as one whose prompt KV arrives from outside; it is Reserved once the
        engine has allocated its blocks (at once, or when blocks free up: the router waits)."""
        if self.kv_recv is None:
            self.transfer.reservations_refused += 1
            self.send(ReserveFailed(request.request_id, f"worker {self.worker_id} is not a decode worker"))
            return
        self.kv_recv.expect(request.request_id)
        try:
            self.core.add_request(Request.from_core_request(request))
        except ValueError as e:
            self.send(ReserveFailed(request.request_id, str(e)))

    def abort(self, request_ids: list[str]) -> None:
        """The engine's connectors close reservations and stop transfers before any block is freed."""
        for rid in request_ids:
            if rid in self.migrating:
                self.migrating.discard(rid)
                self.sender.abort(rid)
            self.reserved_at.pop(rid, None)
            self.prefills.pop(rid, None)
            self.landing.pop(rid, None)
        self.core.abort(request_ids)
        for rid in request_ids:
            self.kv_send.forget(rid)  # a handle for a request that never reached the engine

    # -- around the engine's steps --------------------------------------------------------------
    def on_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        plain = []
        for out in outputs:
            request = self.prefills.pop(out.request_id, None)
            if request is None:
                plain.append(out)
                continue
            # It ran with max_tokens 1: finished, and its connector finished the transfer; the router
            # hears of the token once the KV has landed.
            self.landing[out.request_id] = out
        return plain

    def pending(self) -> bool:
        return bool(self.landing or self.migrating)

    def tick(self) -> None:
        self._report_reservations()
        self._collect_transfers()
        self._expire_reservations()
        now = time.monotonic()
        if self.parent_pid is not None and now - self._last_parent_check >= HEARTBEAT_S:
            self._last_parent_check = now
            if os.getppid() != self.parent_pid:
                log.error("the router that started this worker is gone; exiting")
                self.stop()

    def _report_reservations(self) -> None:
        if self.kv_recv is None:
            return
        for handle in self.kv_recv.take_reserved():
            self.reserved_at[handle.request_id] = time.monotonic()
            self.transfer.reservations += 1
            self.send(Reserved(handle.request_id, handle))

    def _collect_transfers(self) -> None:
        for result in self.sender.poll():
            self.transfer.add(result)
            if result.request_id in self.migrating:
                self._migrated(result)
                continue
            landed = self.landing.pop(result.request_id, None)
            if landed is None:
                continue  # aborted meanwhile
            if result.ok:
                self.send(Prefilled(result.request_id, landed, result))
            else:
                self.send(TransferFailed(result.request_id, result.error))

    def _migrated(self, result: TransferResult) -> None:
        rid = result.request_id
        self.migrating.discard(rid)
        if result.ok:
            self.core.abort([rid])  # its KV is on the target now: the blocks go back to this pool
            self.send(Migrated(rid, True, result))
        else:
            self.send(Migrated(rid, False, result, result.error or "the transfer failed"))

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        stale = [rid for rid, t in self.reserved_at.items() if now - t > RESERVATION_TTL_S]
        if stale:
            log.warning("taking back %d reservations nobody admitted", len(stale))
            self.abort(stale)

    def close(self) -> None:
        self._alive_stop.set()
        if self._alive.is_alive():
            self._alive.join()
        super().close()
        self.sender.close()
        if self.receiver is not None:
            self.receiver.shutdown()
        self.sock.close(linger=500)


def _exit_cleanly(*_: object) -> None:
    raise SystemExit(0)


def run_worker(config: EngineConfig, role: str, router_addr: str, secret: bytes, worker_id: str,
               cores: list[int] | None, kv_transport: str, kv_host: str, parent_pid: int | None = None,
               profile_speed: bool = False, threads_follow_cores: bool = True) -> int:
    num_cores = pin_cores(cores)
    # A worker pinned to n cores runs n threads, more would only fight over them, unless the command
    # line says how many (`tandem serve --num-threads 1` runs its one worker on every core with one).
    if cores and threads_follow_cores:
        config.parallel.num_threads = num_cores
    signal.signal(signal.SIGTERM, _exit_cleanly)
    worker = Worker(config, role, router_addr, secret, worker_id, cores, kv_transport, kv_host, profile_speed)
    worker.parent_pid = parent_pid
    try:
        worker.register()
        startup.info("%s worker %s ready (%d threads); registered with the router at %s", role, worker_id,
                     config.parallel.num_threads, router_addr)
        worker.run()
    finally:
        worker.close()
    return 0
