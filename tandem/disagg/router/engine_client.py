"""What the HTTP layer needs from an engine (the router's, disagg_engine.py): validate and enqueue,
stream outputs per request, abort, report health and stats, and what admission weighs (EngineLoad).

Requests are tokenized and validated here (InputProcessor) and the engine's token outputs come back
through one reader that detokenizes them (OutputProcessor) and hands each RequestOutput to the waiting
request's queue. A request whose consumer goes away (client disconnect, timeout) is aborted in the
engine, which frees its blocks at the next step boundary.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from tandem.disagg.router.engine_load import EngineLoad, Stream
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_report import CoreInfo, CoreStats
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.processor import InputProcessor, ModelLimits, OutputProcessor
from tandem.outputs import RequestOutput
from tandem.policy.admission import PromptRate
from tandem.policy.deadlines import Calibration
from tandem.sampling_params import SamplingParams


class PredictionSink(Protocol):
    """Where admission's error goes: the server's metrics (serve/metrics.py's ServerMetrics) have this face."""

    def observe_ttft_prediction(self, predicted_s: float, measured_s: float) -> None: ...


class EngineDeadError(RuntimeError):
    pass


class EngineRequestError(RuntimeError):
    """The engine failed while running this request (a 500, not the client's fault)."""


class EngineClient(EngineLoad):
    """What the HTTP layer needs from an engine: validate and enqueue, stream outputs per request,
    abort, report health and stats. The router (tandem.disagg.router.disagg_engine) is one, for one
    worker or many; tests drive others."""

    def attach_tokenizer(self, tokenizer: Any | None) -> None:
        """The text side's tokenizer: given at construction, or later by a server that launched its core
        before loading it (DisaggEngine.launch), before start()."""
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
        self.metrics: PredictionSink | None = None

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

    def attach_metrics(self, metrics: PredictionSink) -> None:
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
        work = self.uncached_tokens(prompt_ids, cache_salt)
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
