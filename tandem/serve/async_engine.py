"""The API server's side of the engine: starts the core process and streams outputs per request.

Requests are tokenized and validated here (InputProcessor), sent to the core, and the core's
token outputs come back through one reader task that detokenizes them (OutputProcessor) and hands
each RequestOutput to the waiting request's queue. A request whose consumer goes away (client
disconnect, timeout) is aborted in the core, which frees its blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from tandem.config import EngineConfig
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_report import CoreInfo, CoreStats
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
from tandem.engine.processor import InputProcessor, ModelLimits, OutputProcessor
from tandem.engine.worker_view import host_name, process_cores, worker_entry
from tandem.outputs import RequestOutput
from tandem.policy.admission import PromptRate
from tandem.policy.deadlines import Calibration
from tandem.policy.prefix_index import PrefixIndex
from tandem.restart_backoff import RestartBackoff
from tandem.sampling_params import SamplingParams
from tandem.serve.core_launch import CoreLaunch, core_addresses, run_core
from tandem.serve.engine_load import LOCAL, PREFIX_TTL_S, EngineLoad, Stream
from tandem.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)



class EngineDeadError(RuntimeError):
    pass


class EngineRequestError(RuntimeError):
    """The engine failed while running this request (a 500, not the client's fault)."""


class EngineClient(EngineLoad):
    """What the HTTP layer needs from an engine: validate and enqueue, stream outputs per request,
    abort, report health and stats. AsyncEngine drives one local core; the disaggregated router
    (tandem.disagg.router.disagg_engine) drives a cluster of workers behind the same interface."""

    def attach_tokenizer(self, tokenizer: Any | None) -> None:
        """The text side's tokenizer: given at construction, or later by a server that launched its core
        before loading it (AsyncEngine.launch), before start()."""
        self.tokenizer = tokenizer
        self.outputs = OutputProcessor(tokenizer)

    def __init__(self, tokenizer: Any | None) -> None:
        self.attach_tokenizer(tokenizer)
        self.info: CoreInfo | None = None
        self.stats: CoreStats | None = None
        self.inputs: InputProcessor | None = None
        self.streams: dict[str, Stream] = {}
        self.dead: str | None = None
        self.listeners: list = []  # callables(RequestOutput) for metrics
        self.prompt_rate = PromptRate()
        self.token_gap_s = 0.05  # smoothed time between a stream's outputs: how fast seats free up
        self.step_budget = 0  # max_num_batched_tokens, once started
        self.calibration = Calibration()  # first tokens against their predictions (admission's bias)
        # The prompt blocks sent to the engine lately, to predict prefix-cache hits before admitting
        # (the router's approximate mode: a block counts as cached for a while after it was sent).
        self.sent_blocks = PrefixIndex(predict_ttl_s=PREFIX_TTL_S)
        self.metrics: ServerMetrics | None = None

    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self) -> None:
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        raise NotImplementedError

    def _submit(self, requests: list[EngineCoreRequest]) -> None:
        """Send the validated engine requests on their way (synchronously)."""
        raise NotImplementedError

    async def _abort_in_engine(self, child_ids: list[str]) -> None:
        raise NotImplementedError

    async def release_kv(self, handles: list[str]) -> None:
        """Stored conversations' KV no longer kept (generate's retain_as handles)."""
        raise NotImplementedError

    def cluster(self) -> dict[str, Any]:
        """The deployment as the dashboard draws it: mode, router, workers, transfers, planner
        (serve/cluster_view.py adds the rest of GET /v1/cluster)."""
        raise NotImplementedError

    async def migrate_from(self, worker_id: str) -> dict[str, Any]:
        """Move every request a worker decodes to others, KV and all (a cluster's; LookupError: not
        a worker of this deployment)."""
        raise LookupError("this deployment is one engine: there is no worker to move requests between")

    def attach_metrics(self, metrics: ServerMetrics) -> None:
        """Register engine-specific series next to the server's (engines with more to say extend it)."""
        self.metrics = metrics

    def _make_inputs(self, max_num_batched_tokens: int, enable_chunked_prefill: bool) -> None:
        assert self.info is not None
        self.step_budget = max_num_batched_tokens
        self.inputs = InputProcessor(self.tokenizer, ModelLimits(
            self.info.max_model_len, self.info.vocab_size, self.info.eos_token_ids, max_num_batched_tokens,
            enable_chunked_prefill))

    def health(self) -> dict[str, Any]:
        if self.healthy:
            return {"status": "ok", "reasons": []}
        return {"status": "unhealthy", "reasons": [self.dead or "engine is not running"]}

    def capacity(self) -> int:
        """Sequences the engine runs at once (its max_num_seqs; a cluster's, summed over decode workers)."""
        return self.info.max_num_seqs if self.info is not None else 1

    def _set_stats(self, stats: CoreStats | None) -> None:
        self.stats = stats
        if stats is not None:
            self.prompt_rate.observe(stats.prompt_busy_s, stats.num_computed_prompt_tokens)

    # -- requests -----------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], params: SamplingParams, prompt_text: str | None = None,
                 cache_salt: str | None = None, request_id: str | None = None, priority: int = 0,
                 tenant: str | None = None, tenant_weight: float = 1.0, timeout: float | None = None,
                 retain_as: str | None = None) -> AsyncIterator[RequestOutput]:
        """Validate (ValueError on bad input) and enqueue now; the returned iterator yields outputs until
        the request finishes. Closing it early aborts the request.

        Enqueueing is synchronous so that admission control sees every accepted request at once,
        even before anyone iterates. retain_as: keep the finished conversation's KV cached under this
        handle until release_kv (a stored response's)."""
        if not self.healthy:
            raise EngineDeadError(self.dead or "engine is not running")
        assert self.inputs is not None
        rid = request_id or uuid.uuid4().hex
        requests = self.inputs.make_requests(rid, prompt_ids, params, cache_salt, priority=priority, tenant=tenant,
                                             tenant_weight=tenant_weight, retain_kv_as=retain_as)
        limit = self.info.max_model_len - len(prompt_ids) if self.info is not None else 1 << 20
        keys = self._block_keys(prompt_ids, cache_salt)
        work = self.uncached_tokens(prompt_ids, cache_salt, keys)  # hashed once
        self.sent_blocks.predict(LOCAL, keys)
        now = time.monotonic()
        # Admission keeps a request's last token within its timeout only when it named max_tokens: one
        # that runs until the context is full would be predicted at the whole context, and protecting
        # that guess would refuse every arrival (its real length is unknown, as the finish rule says).
        stream = Stream(tenant=tenant, prompt_tokens=work, num_seqs=len(requests),
                         tokens_left=min(params.max_tokens or limit, limit), requests=requests,
                         created=now, predicted_ttft_s=self._predicted_ttft(tenant, work, len(requests)),
                         deadline=now + timeout if timeout is not None and params.max_tokens else float("inf"))
        self.streams[rid] = stream
        self.outputs.add(rid, prompt_text, requests)
        self._submit(requests)
        return self._consume(rid, stream)

    async def _consume(self, rid: str, stream: Stream) -> AsyncIterator[RequestOutput]:
        stream.consuming = True
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self.streams.pop(rid, None)
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        children = self.outputs.child_ids(request_id)
        self.outputs.abort(request_id)
        if children:
            await self._abort_in_engine(children)

    def _fail(self, request_id: str, error: Exception) -> None:
        stream = self.streams.get(request_id)
        self.outputs.abort(request_id)
        if stream is not None:
            stream.queue.put_nowait(error)

    def _fail_children(self, child_ids: list[str], error: Exception) -> None:
        parents = {self.outputs.child_to_parent.get(c) for c in child_ids} - {None}
        for rid in parents:
            self._fail(rid, error)

    def _deliver(self, core_outputs: list[EngineCoreOutput]) -> list[str]:
        """Detokenize and hand outputs to their streams; returns the child ids a stop string ended,
        which the caller aborts in the engine."""
        results, stopped = self.outputs.process(core_outputs)
        now = time.monotonic()
        for out in results:
            for listener in self.listeners:
                listener(out)
            stream = self.streams.get(out.request_id)
            if stream is not None:
                new = max((len(d[1]) for d in out.deltas), default=0)
                if stream.first_output and new:
                    self.token_gap_s += 0.05 * ((now - stream.last_output) / new - self.token_gap_s)
                stream.tokens_left = max(stream.tokens_left - new, 0)
                stream.tokens_done += new
                stream.last_output = now
                if not stream.first_output:
                    stream.first_at = now
                    if stream.predicted_ttft_s:
                        self.calibration.observe(stream.predicted_ttft_s, now - stream.created)
                        if self.metrics is not None and stream.predicted_ttft_s > 0.01:
                            self.metrics.observe_ttft_prediction(stream.predicted_ttft_s, now - stream.created)
                stream.first_output = True
                stream.queue.put_nowait(out)
                if out.finished and not stream.consuming:
                    del self.streams[out.request_id]
        return stopped


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
