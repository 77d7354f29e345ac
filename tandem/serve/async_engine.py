"""The single server's engine client: one local engine core in a process of its own, started (and
started again after a crash, with its requests sent again) and fed over ZeroMQ PUSH/PULL.

What every engine client does (validate, stream per request, abort, admission's inputs) is
EngineClient's (disagg/router/engine_client.py), shared with a cluster's router.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.disagg.router.engine_client import EngineClient, EngineDeadError, EngineRequestError
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import (
    AbortRequests,
    AddRequests,
    Ready,
    ReleaseKV,
    RequestsFailed,
    Shutdown,
    StartupFailed,
    StepOutputs,
)
from tandem.engine.worker_view import host_name, process_cores, worker_entry
from tandem.restart_backoff import RestartBackoff
from tandem.serve.core_launch import CoreLaunch, core_addresses, run_core

log = logging.getLogger(__name__)



class AsyncEngine(EngineClient):
    def __init__(self, config: EngineConfig, tokenizer: Any | None, log_level: str = "WARNING",
                 startup_timeout: float = 300.0, kv_events_endpoint: str | None = None,
                 profile_speed: bool = False, launched: CoreLaunch | None = None) -> None:
        """launched: a core process already started from the same settings (core_launch.launch_core),
        adopted here as if launch() had started it."""
        super().__init__(tokenizer)
        self.kv_events_endpoint = kv_events_endpoint
        self.profile_speed = profile_speed  # time the core's steps at start (admission predicts from them)
        self.config = config
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tmp = launched.tmp if launched is not None else tempfile.TemporaryDirectory(prefix="tandem-")
        self._ctx = zmq.asyncio.Context()
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._addresses = ("", "")
        self.restart_backoff = RestartBackoff()
        self._started_at = 0.0  # on restart_backoff's clock
        if launched is not None:
            self._proc, self._addresses = launched.proc, launched.addresses
            self._started_at = self.restart_backoff.clock()

    # -- lifecycle ----------------------------------------------------------------------------
    def _spawn(self) -> None:
        self._proc = multiprocessing.get_context("spawn").Process(
            target=run_core, args=(self.config, *self._addresses, self.log_level, self.kv_events_endpoint,
                                   self.profile_speed),
            daemon=True, name="tandem-engine-core")
        self._proc.start()
        self._started_at = self.restart_backoff.clock()

    def launch(self) -> None:
        """Start the core process now, so that its imports and model load overlap the rest of the server's
        start-up (on two cores they run side by side); start() then binds and waits for it. The core
        connects first: ZeroMQ holds what it sends until the server's sockets are bound."""
        if self._proc is not None:
            return
        self._addresses = core_addresses(self._tmp)
        self._spawn()

    async def start(self) -> None:
        self.launch()
        in_addr, out_addr = self._addresses
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(out_addr)
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while True:
            # Looked at before polling: a core that says why it failed and exits is read, not raced.
            alive = self._proc.is_alive()
            if await self._pull.poll(500):
                msg = await self._pull.recv_pyobj()
                if isinstance(msg, Ready):
                    self.info = msg.info
                elif isinstance(msg, StepOutputs) and self.info is not None:
                    self._set_stats(msg.stats)  # its first report, right after Ready: up, with its pool known
                    break
                if isinstance(msg, StartupFailed):
                    raise RuntimeError(f"engine core failed to start: {msg.reason}")
                continue
            if not alive:
                raise RuntimeError(f"engine core exited during start-up (exit code {self._proc.exitcode})")
            if time.monotonic() > deadline:
                raise RuntimeError("engine core did not start in time")
        self._make_inputs(self.config.scheduler.max_num_batched_tokens, self.config.scheduler.enable_chunked_prefill)
        self._reader = asyncio.create_task(self._read_outputs())
        self._watchdog = asyncio.create_task(self._watch_process())

    async def shutdown(self) -> None:
        for rid in list(self.streams):
            self._fail(rid, EngineDeadError("server shutting down"))
        if self._proc is not None and self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                await self._push.send_pyobj(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, self._proc.join, 10)
            if self._proc.is_alive():
                self._proc.kill()
        for task in (self._reader, self._watchdog):
            if task is not None:
                task.cancel()
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        self._tmp.cleanup()

    @property
    def healthy(self) -> bool:
        return self.dead is None and self._proc is not None and self._proc.is_alive()

    def cluster(self) -> dict[str, Any]:
        pid = self._proc.pid if self._proc is not None else None
        state = "up" if self.healthy else ("starting" if self.dead is None else "dead")
        core = worker_entry("engine-core", "colocated", state, pid, host_name(), process_cores(pid), self.stats)
        return {"mode": "colocated", "router": None, "workers": [core], "transfers": [], "planner": None}

    # -- requests -----------------------------------------------------------------------------
    def _submit(self, requests: list[EngineCoreRequest]) -> None:
        # Not awaited: zmq.asyncio sends in call order, and this keeps enqueueing atomic.
        self._push.send_pyobj(AddRequests(requests))

    async def _abort_in_engine(self, child_ids: list[str]) -> None:
        if self.healthy:
            await self._push.send_pyobj(AbortRequests(child_ids))

    async def release_kv(self, handles: list[str]) -> None:
        if self.healthy and handles:
            await self._push.send_pyobj(ReleaseKV(handles))

    async def _read_outputs(self) -> None:
        while True:
            msg = await self._pull.recv_pyobj()
            if isinstance(msg, StepOutputs):
                self._set_stats(msg.stats)
                if not msg.outputs:
                    continue
                stopped = self._deliver(msg.outputs)
                if stopped:
                    await self._push.send_pyobj(AbortRequests(stopped))
            elif isinstance(msg, RequestsFailed):
                self._fail_children(msg.request_ids, EngineRequestError(msg.message))
            elif isinstance(msg, Ready):  # a restarted core: what had not started yet is sent again
                self.info, self.dead = msg.info, None
                waiting = [s for s in self.streams.values() if not s.first_output]
                log.warning("engine core is back; sending %d waiting requests again", len(waiting))
                for stream in waiting:
                    self._push.send_pyobj(AddRequests(stream.requests))
            elif isinstance(msg, StartupFailed):
                log.error("engine core failed to start again: %s", msg.reason)

    async def _watch_process(self, sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        """A core that dies is started again after the restart backoff (tandem/restart_backoff.py).
        Requests that streamed something fail (their state died with it); the others wait and are
        sent again once it is back. Meanwhile the server answers 503 and /health is unhealthy."""
        while True:
            await sleep(0.5)
            if self._proc is None or self._proc.is_alive():
                continue
            self.dead = f"engine core died (exit code {self._proc.exitcode})"
            for rid, stream in list(self.streams.items()):
                if stream.first_output:
                    self._fail(rid, EngineDeadError(self.dead))
            delay = self.restart_backoff.next_delay(self._started_at)
            log.error("%s; starting it again in %.0f s", self.dead, delay)
            await sleep(delay)
            self._spawn()
