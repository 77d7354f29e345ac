"""The per-request flow through the cluster: choose a path and workers, then carry the request
along it, with a timeout on every wait and a way back from every failure.

  0. predict each path's TTFT and TPOT (paths.py) over the workers the routing policy picks in each
     pool (routing.py) and take the one with the most SLO headroom;
  whole on one worker: send it there (colocated, prefill-free, or a decode worker's own prefill);
  disaggregated:
  1. ask the decode worker to reserve blocks for the prompt -> a TransferHandle (retried while it
     has no room, up to reserve_timeout);
  2. send the request to the prefill worker with the handle; it computes the prompt, ships the KV
     layer by layer and answers with the first token once the KV has landed;
  3. deliver that token and tell the decode worker to admit the request; its tokens stream back.
A failed transfer releases the reservation and the request is retried on another pair, or run
whole on one worker when no pair is left.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from tandem.disagg.router.engine_client import EngineDeadError
from tandem.disagg.router.flight import (
    Flight,
    Phase,
    WorkerLost,
    first_token_output,
    migrated_request,
    prefill_request,
    reserve_request,
)
from tandem.disagg.router.registry import PREFILL_CAPABLE, WorkerHandle, WorkerRegistry
from tandem.disagg.router.settings import RouterCounters, RouterSettings
from tandem.disagg.router.store_view import StoreView
from tandem.disagg.worker.messages import (
    Admit,
    FlightReply,
    Migrated,
    MigrateKV,
    Pause,
    Paused,
    Prefill,
    Prefilled,
    Reserve,
    Reserved,
    Resume,
    TransferFailed,
)
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_report import CoreInfo
from tandem.engine.messages import AbortRequests, AddRequests
from tandem.kv.hashing import block_keys
from tandem.policy.paths import PathOption, Slo, choose, predict_disaggregated, predict_local, predict_prefill_free
from tandem.policy.routing import Pick, Router

log = logging.getLogger(__name__)

Send = Callable[[WorkerHandle, object], Awaitable[bool]]
BIAS_ALPHA = 0.2
WORKER_WAIT_POLL_S = 0.1


class Dispatcher:
    def __init__(self, settings: RouterSettings, registry: WorkerRegistry, router: Router, slo: Slo,
                 path_policy: str, send: Send, deliver: Callable[[list[EngineCoreOutput]], Awaitable[None]],
                 counters: RouterCounters) -> None:
        self.settings, self.registry, self.router, self.slo = settings, registry, router, slo
        self.path_policy = path_policy
        self.send, self.deliver, self.counters = send, deliver, counters
        # Whether a worker is on its way (started again after a death, not yet joined): a request with
        # no live worker to run on waits for it rather than failing (the router sets it).
        self.expecting_worker: Callable[[], bool] = lambda: False
        self.info: CoreInfo | None = None  # the first worker's limits and block keying
        self.store: StoreView | None = None
        self.abort_acks: dict[str, tuple[asyncio.Future, WorkerHandle]] = {}
        # Per path, what its requests measured beyond what was predicted (router and messaging time,
        # contention the speeds do not show), smoothed: added to later predictions of that path.
        self.bias: dict[str, list[float]] = {}

    # -- bookkeeping ----------------------------------------------------------------------------
    def assign(self, flight: Flight, prefill: WorkerHandle | None, decode: WorkerHandle | None) -> None:
        for w in flight.workers():
            w.inflight.discard(flight.request.request_id)
        flight.prefill, flight.decode = prefill, decode
        for w in flight.workers():
            w.inflight.add(flight.request.request_id)

    def on_reply(self, flight: Flight, reply: FlightReply) -> None:
        if flight.reply is not None and not flight.reply.done():
            flight.reply.set_result(reply)

    def on_aborted(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            ack = self.abort_acks.get(rid)
            if ack is not None and not ack[0].done():
                ack[0].set_result(None)

    def on_worker_lost(self, worker: WorkerHandle, reason: str) -> None:
        for ack, prefill in list(self.abort_acks.values()):
            if prefill is worker and not ack.done():
                ack.set_exception(WorkerLost(reason))  # a dead worker writes nothing more

    async def _ask(self, flight: Flight, worker: WorkerHandle, timeout: float, msg: object) -> FlightReply:
        """Send msg and wait for the worker's reply about this request."""
        flight.reply = asyncio.get_running_loop().create_future()
        if not await self.send(worker, msg):
            raise WorkerLost(f"worker {worker.worker_id} is unreachable")
        try:
            return await asyncio.wait_for(flight.reply, timeout)
        finally:
            flight.reply = None

    # -- choosing -------------------------------------------------------------------------------
    def _prompt_left(self, flight: Flight, overlap_blocks: int) -> int:
        """The prompt's tokens past a cached overlap: what is left to prefill."""
        bs = self.info.block_size if self.info is not None else 16
        return max(flight.request.num_prompt_tokens - overlap_blocks * bs, 1)

    def options(self, flight: Flight) -> list[PathOption]:
        """The paths this request can take now, best-first when the policy does not predict."""
        reg, request = self.registry, flight.request
        pick = lambda workers: self.router.pick(flight.keys, flight.num_blocks, workers)  # noqa: E731
        decode = pick(reg.routable("decode"))
        out: list[PathOption] = []
        if decode is not None and self.store is not None and self.store.prefill_free(request):
            tail = request.num_prompt_tokens - self.store.num_stored_tokens(request)
            out.append(PathOption("prefill-free", None, decode.worker,
                                  *predict_prefill_free(reg.speed(decode.worker), tail)))
        # Each pool is picked from once: a pick may advance its pool's round-robin turn.
        # A colocated worker prefills for a decode worker under either policy: that is a pair too.
        predicts = self.path_policy == "slo"
        prefill = pick(reg.routable(*PREFILL_CAPABLE)) if decode is not None else None
        whole: list[Pick] = []
        if predicts or prefill is None:  # disaggregated: run whole only without a pair
            whole = [p for p in (pick(reg.routable("colocated")), decode) if p is not None]
            whole = whole if predicts else whole[:1]
        for p in whole:
            ttft, tpot, stall = predict_local(reg.speed(p.worker), self._prompt_left(flight, p.overlap_blocks),
                                              request.sampling_params.max_tokens)
            out.append(PathOption("colocated", None, p.worker, ttft, tpot, stall, p.overlap_blocks))
        if prefill is not None and decode is not None and prefill.worker is not decode.worker:
            ttft, tpot, stall = predict_disaggregated(reg.speed(prefill.worker), reg.speed(decode.worker),
                                                      self._prompt_left(flight, prefill.overlap_blocks),
                                                      request.sampling_params.max_tokens)
            out.append(PathOption("disaggregated", prefill.worker, decode.worker, ttft, tpot, stall,
                                  prefill.overlap_blocks))
        return out

    def learn(self, flight: Flight, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request finished: move its path's bias toward what it measured over the prediction."""
        bias = self.bias.setdefault(flight.path, [0.0, 0.0])
        for i, (measured, predicted) in enumerate(((ttft_s, flight.predicted_ttft_s),
                                                   (tpot_s, flight.predicted_tpot_s))):
            if measured is not None and predicted is not None:
                bias[i] += BIAS_ALPHA * (measured - predicted)

    def choose(self, flight: Flight) -> PathOption | None:
        options = self.options(flight)
        if not options:
            return None
        for o in options:
            ttft_bias, tpot_bias = self.bias.get(o.path, (0.0, 0.0))
            o.ttft_s, o.tpot_s = max(o.ttft_s + ttft_bias, 0.0), max(o.tpot_s + tpot_bias, 0.0)
        best = choose(options, self.slo) if self.path_policy == "slo" else options[0]
        computes = best.prefill or best.decode
        self.counters.count_route(best.path, computes.worker_id, best.overlap_blocks, len(flight.keys))
        for w in {id(w): w for w in (best.prefill, best.decode) if w is not None}.values():
            self.router.routed(w, flight.keys)
        if best.path != "prefill-free":
            computes.rates.sent_prompt_tokens += self._prompt_left(flight, best.overlap_blocks)
        flight.path, flight.predicted_ttft_s, flight.predicted_tpot_s = best.path, best.ttft_s, best.tpot_s
        return best

    # -- the flow -------------------------------------------------------------------------------
    async def route(self, flight: Flight) -> None:
        if self.info is not None and not flight.keys:
            flight.keys = block_keys(flight.request.prompt_token_ids, self.info.block_size, self.info.hash_algo,
                                     self.info.block_key_extra, flight.request.cache_salt)
            flight.num_blocks = -(-flight.request.num_prompt_tokens // self.info.block_size)
        for attempt in range(self.settings.max_attempts):
            option = self.choose(flight)
            if option is None:
                break
            if attempt:
                self.counters.retries += 1
            if option.path != "disaggregated":
                self.counters.prefill_free += option.path == "prefill-free"
                await self.run_whole(flight, option.decode)
                return
            try:
                if await self.run_disaggregated(flight, option.prefill, option.decode):
                    return
            except (WorkerLost, TimeoutError) as e:
                log.warning("request %s: %s; retrying", flight.request.request_id, e or type(e).__name__)
            await self.release(flight)
        flight.path = "fallback"
        self.counters.fallbacks += 1
        await self.run_whole(flight, None)

    async def run_disaggregated(self, flight: Flight, prefill: WorkerHandle, decode: WorkerHandle) -> bool:
        """True when the request is decoding (or done); False to try something else."""
        rid = flight.request.request_id
        self.assign(flight, prefill, decode)
        flight.phase = Phase.RESERVE
        t0 = time.monotonic()
        reserve = Reserve(reserve_request(flight.request))
        while True:
            reply = await self._ask(flight, decode, self.settings.reserve_timeout, reserve)
            if isinstance(reply, Reserved):
                break
            if time.monotonic() - t0 > self.settings.reserve_timeout:
                log.warning("request %s: decode worker %s had no room for %.1f s", rid, decode.worker_id,
                            self.settings.reserve_timeout)
                self.assign(flight, None, None)
                return False
            await asyncio.sleep(0.05)  # blocks free up as other requests finish
        self.counters.reserve_wait_s.append(time.monotonic() - t0)
        flight.phase = Phase.PREFILL
        done = await self._ask(flight, prefill, self.settings.prefill_timeout,
                               Prefill(prefill_request(flight.request), reply.handle))
        if isinstance(done, TransferFailed):
            log.warning("request %s: KV transfer %s -> %s failed: %s", rid, prefill.worker_id, decode.worker_id,
                        done.reason)
            return False
        assert isinstance(done, Prefilled)
        self.counters.disaggregated += 1
        self.counters.count_transfer(prefill.worker_id, decode.worker_id, done.result.num_bytes if done.result else 0)
        self.assign(flight, None, decode)
        first = first_token_output(flight.request, done.output, self.info.max_model_len if self.info else 1 << 62)
        if first.finished:  # the first token ended it: the reservation is not needed
            await self.send(decode, AbortRequests([rid]))
        else:
            flight.phase = Phase.DECODE
            await self.send(decode, Admit(rid, first.new_token_ids[0]))
        await self.deliver([first])
        return True

    async def migrate(self, flight: Flight, target: WorkerHandle) -> str | None:
        """Move a decoding request, KV and all, from the worker streaming it to target (one that
        receives KV: decode or colocated). None when it moved; else why not, the request decoding
        on where it was. Raises WorkerLost when the source died (the request's KV died with it)."""
        rid, source = flight.request.request_id, flight.decode
        if source is None or source is target or not flight.phase.streaming or flight.phase == Phase.MIGRATE:
            return "not decoding on another worker"
        phase = flight.phase
        flight.phase = Phase.MIGRATE
        self.assign(flight, target, source)  # both hold it meanwhile: an abort or a death reaches both
        moved = reserving = shipping = False
        try:
            try:
                paused = await self._ask(flight, source, self.settings.heartbeat_timeout, Pause(rid))
                assert isinstance(paused, Paused)
                if paused.output_token_ids is None:
                    return paused.reason
                outputs = paused.output_token_ids
                reserving = True
                reply = await self._ask(flight, target, self.settings.reserve_timeout,
                                        Reserve(migrated_request(flight.request, outputs)))
                if not isinstance(reply, Reserved):
                    return f"the target has no room: {getattr(reply, 'reason', '')}"
                shipping = True
                done = await self._ask(flight, source, self.settings.prefill_timeout, MigrateKV(rid, reply.handle))
                shipping = False
            except (WorkerLost, TimeoutError) as e:
                if not source.alive:
                    raise WorkerLost(f"worker {source.worker_id} died while its request was moving") from e
                return f"no answer: {e or type(e).__name__}"
            assert isinstance(done, Migrated)
            if not done.ok:
                return f"the KV transfer failed: {done.reason}"
            moved = True
            self.counters.migrations += 1
            self.counters.count_transfer(source.worker_id, target.worker_id,
                                         done.result.num_bytes if done.result else 0)
            self.assign(flight, None, target)
            flight.phase = phase
            await self.send(target, Admit(rid, outputs[-1]))
            return None
        finally:
            if not moved:
                flight.phase = phase
                self.assign(flight, None, source)
                if source.alive:
                    await self.send(source, Resume(rid))
                # A reservation it may hold goes back, unless a live source may be writing into it
                # still (it never answered): then the target takes it back when it expires.
                if reserving and target.alive and not (shipping and source.alive):
                    await self.send(target, AbortRequests([rid]))

    async def release(self, flight: Flight) -> None:
        """Undo a failed attempt before the next one (which reuses the request id)."""
        prefill, decode = flight.prefill, flight.decode
        self.assign(flight, None, None)
        await self.stop(flight.request.request_id, prefill, decode)

    async def stop(self, rid: str, prefill: WorkerHandle | None, decode: WorkerHandle | None) -> None:
        """Abort on both sides. The decode worker's reserved blocks go back to its pool only after
        the prefill worker confirms it stopped, so no late write can land in blocks that were
        already given to another request."""
        if prefill is not None and prefill.alive:
            ack = asyncio.get_running_loop().create_future()
            self.abort_acks[rid] = (ack, prefill)
            try:
                if await self.send(prefill, AbortRequests([rid])):
                    await asyncio.wait_for(ack, self.settings.heartbeat_timeout)
            except (TimeoutError, WorkerLost):
                pass  # not confirmed: the worker is dead or about to be declared so
            finally:
                self.abort_acks.pop(rid, None)
        if decode is not None and decode is not prefill and decode.alive:
            await self.send(decode, AbortRequests([rid]))

    async def run_whole(self, flight: Flight, worker: WorkerHandle | None) -> None:
        """The whole request on one worker: the one chosen, or, as a fallback when no path could take
        it, the least-loaded colocated (else decode, else any) worker."""
        reg = self.registry

        def fallbacks() -> list[WorkerHandle]:
            return reg.routable("colocated") or reg.routable("decode") or reg.routable() or reg.live()

        if worker is None:
            candidates = fallbacks()
            while not candidates and self.expecting_worker():  # its own timeout bounds the wait
                await asyncio.sleep(WORKER_WAIT_POLL_S)
                candidates = fallbacks()
            if not candidates:
                raise EngineDeadError("no live worker to serve the request")
            worker = min(candidates, key=lambda w: (w.load, w.worker_id))
        self.counters.colocated += 1
        self.assign(flight, None, worker)
        flight.phase = Phase.WHOLE
        # A fresh copy: the request object may have been sent before and must start clean.
        if not await self.send(worker, AddRequests([flight.request])):
            raise WorkerLost(f"worker {worker.worker_id} is unreachable")
