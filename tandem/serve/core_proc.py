"""The engine core in its own process, stepping continuously, talking ZeroMQ.

HTTP parsing, tokenization and detokenization happen in the API server's process; this one only
schedules and runs the model, so a burst of HTTP work never delays a step. It runs the engine
service loop (engine/service.py) over local IPC sockets; messages are the typed ones of
engine/messages.py, pickled (both ends are this project's own processes).

  frontend -> core (PUSH/PULL): AddRequests, AbortRequests, Shutdown
  core -> frontend (PUSH/PULL): Ready (or StartupFailed), StepOutputs, RequestsFailed
  core -> anyone (PUB, optional): KVEvents after each step that changed the prefix cache, for a
                                  KV-aware router
"""

from __future__ import annotations

import logging
import os
import signal
import time

import zmq

from tandem import logs
from tandem.config import EngineConfig
from tandem.engine.core import EngineCore
from tandem.engine.messages import KVEvents, Ready, StartupFailed
from tandem.engine.service import EngineService
from tandem.process_exit import exit_now

log = logging.getLogger(__name__)


class CoreService(EngineService):
    def __init__(self, core: EngineCore, inp: zmq.Socket, out: zmq.Socket, kv_pub: zmq.Socket | None) -> None:
        super().__init__(core)
        self.inp, self.out, self.kv_pub = inp, out, kv_pub
        self.poller = zmq.Poller()
        self.poller.register(inp, zmq.POLLIN)

    def receive(self, timeout_s: float) -> list[object]:
        msgs: list[object] = []
        while self.poller.poll(0 if msgs else int(timeout_s * 1000)):
            msgs.append(self.inp.recv_pyobj())
        return msgs

    def send(self, msg: object) -> None:
        if isinstance(msg, KVEvents):
            if self.kv_pub is not None:  # PUB drops when nobody listens: publishing never blocks a step
                self.kv_pub.send_pyobj(msg)
            return
        self.out.send_pyobj(msg)


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, log_level: str = "WARNING",
                    kv_events_endpoint: str | None = None, profile_speed: bool = False) -> None:
    """Process entry point."""
    logs.setup(log_level, process="core")
    # The parent handles SIGINT/SIGTERM and tells us to shut down; don't die half-way through a step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    kv_pub = None
    if kv_events_endpoint:
        config.cache.enable_kv_events = True
        kv_pub = ctx.socket(zmq.PUB)
        kv_pub.bind(kv_events_endpoint)
    try:
        from tandem.engine.core_report import core_info
        from tandem.engine.worker_group import load_engine_model

        t0 = time.perf_counter()
        loaded = load_engine_model(config, log_level)
        core = EngineCore(config, loaded.model, tokenizer=lambda: loaded.tokenizer)
        if profile_speed:
            core.profile_speed()
        out.send_pyobj(Ready(core_info(core, loaded)))
        logs.startup.info("engine core ready in %.1f s", time.perf_counter() - t0)
    except Exception as e:  # report why we could not start, then exit non-zero
        out.send_pyobj(StartupFailed(f"{type(e).__name__}: {e}"))
        out.close(linger=10000)  # the server binds after it launches us: give it time to read why
        os._exit(1)
    service = CoreService(core, inp, out, kv_pub)
    try:
        service.run()
    finally:
        service.close()
    out.close(linger=1000)
    if kv_pub is not None:
        kv_pub.close(linger=0)
    inp.close(linger=0)
    ctx.term()
    exit_now(0)  # everything is closed: skip the interpreter's teardown (process_exit.py)
