"""EngineCore: one step = schedule, run the model, sample, update. Token ids in, token ids out.

It knows nothing of text: tokenizing, detokenizing and stop strings live in the frontend
(LLMEngine offline, the API server's process online), so the core can run in its own process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, TypeVar

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.engine import step_time_cache
from tandem.engine.connectors.base import KVConnector
from tandem.engine.connectors.multi import MultiConnector
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.grammars import Grammars
from tandem.engine.host_load import WINDOW_S, wait_until_quiet
from tandem.engine.kv_layout import engine_kv_layout
from tandem.engine.request import Request, RequestStatus
from tandem.engine.runner import ModelRunner, RunnerOutput, StepTimings, num_kv_blocks
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_profile import profile_speed, profile_step_cost, profiled_counts, speed_passes
from tandem.engine.speed import SpeedTracker, StepSpeed
from tandem.engine.step import SchedulerOutput, SchedulerStats
from tandem.engine.step_meter import StepMeter
from tandem.engine.structured import StructuredState
from tandem.kv.block_pool import BlockEvent
from tandem.logs import startup
from tandem.model.causal_lm import CausalLM
from tandem.model.fingerprint import weights_fingerprint
from tandem.ops.extension import extension_error, extension_isa, load_extension
from tandem.parallel.shm import GroupFailed
from tandem.speculative.decoder import SpecDecoder
from tandem.speculative.policy import StepCost

log = logging.getLogger(__name__)
T = TypeVar("T")


def _quietly(measure: Callable[[], T]) -> T:
    """measure() once no other process keeps this engine's cores busy (host_load.py): a profile timed
    beside a starting API process would be kept, and mislead, for every later start."""
    waited = wait_until_quiet()
    if waited > WINDOW_S:
        startup.info("step times: waited %.1f s for the other processes on these cores to go quiet", waited)
    return measure()


def kv_block_nbytes(config: EngineConfig, model: CausalLM) -> int:
    """A block of every layer and KV head of the whole model (a worker group's ranks' heads together)."""
    arch = model.cfg
    if model.kv_head_ranges:
        arch = replace(arch, num_kv_heads=max(h1 for _, h1 in model.kv_head_ranges))
    return engine_kv_layout(config, arch).bytes_per_token(arch) * config.cache.block_size


def with_store(connector: KVConnector | None, config: EngineConfig, model: CausalLM, fingerprint: int) -> KVConnector:
    """The engine's connector: the one it was given, and the tiered store when one is configured
    (after it, so that a decode worker's expected prompts arrive from their prefill worker)."""
    settings = config.cache.store_settings()
    if not settings.enabled:
        return connector or KVConnector()
    from tandem.engine.connectors.store import StoreConnector
    from tandem.kv.store.tiered import TieredStore, open_tiers

    block_nbytes = kv_block_nbytes(config, model)
    ident = f"{fingerprint & (2**64 - 1):016x}-{block_nbytes}"
    store = StoreConnector(TieredStore(open_tiers(settings, block_nbytes, ident), block_nbytes),
                           config.cache.block_size)
    startup.info("KV store: %s", ", ".join(t.name for t in store.store.tiers))
    return store if connector is None else MultiConnector([connector, store])


class EngineCore:
    def __init__(self, config: EngineConfig, model: CausalLM, connector: KVConnector | None = None,
                 tokenizer: Callable[[], Any | None] | None = None, shared_kv: bool = False) -> None:
        """tokenizer: loads the model's tokenizer, on the first grammar-constrained request (an engine
        needs nothing else of it). shared_kv: the KV pool in memory other processes map (a prefill
        worker writes into it)."""
        threads = max(1, config.parallel.num_threads // config.parallel.world_size)  # each rank's share
        torch.set_num_threads(threads)
        if torch.device(config.model.device).type == "cpu":
            # Loaded (or, if set-up was skipped, built) now rather than on the first step.
            startup.info("kernels: %s; %d threads", f"compiled ({extension_isa()})" if load_extension() else
                         f"PyTorch fallbacks ({extension_error() or 'disabled'})", threads)
        self.config = config
        num_blocks = num_kv_blocks(config, model.cfg)
        self.max_model_len = min(config.model.max_model_len or model.cfg.max_position_embeddings,
                                 model.cfg.max_position_embeddings, num_blocks * config.cache.block_size)
        fingerprint = model.fingerprint
        if fingerprint is None:
            fingerprint = weights_fingerprint(model.state_dict(), config.model.torch_dtype)
        # Part of every block's key: equal keys mean equal KV on every process and host.
        layout = engine_kv_layout(config, model.cfg)
        self.block_key_extra = (fingerprint, config.cache.block_size)
        if layout.quantized:  # int8 rows are other bytes than the model dtype's: never each other's hits
            self.block_key_extra += (layout.name,)
        self.connector = with_store(connector, config, model, fingerprint)
        self.runner = ModelRunner(config, model, num_blocks, self.connector, shared_kv)
        # Grammar-constrained requests need the tokenizer's strings; without one they fail in their step.
        self.structured = StructuredState(Grammars(None, model.cfg.vocab_size, load=tokenizer)) \
            if tokenizer is not None else None
        self.runner.structured = self.structured
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, self.max_model_len, self.connector,
                                   self.block_key_extra)
        self.spec = self._spec_decoder(config)
        self.meter = StepMeter()
        startup.info("KV pool: %.2f GiB = %d tokens (%d blocks of %d; %s, %d bytes a token), max_model_len %d",
                     self.runner.kv_pool.nbytes / 2**30,
                     num_blocks * config.cache.block_size, num_blocks, config.cache.block_size, layout.name,
                     layout.bytes_per_token(model.cfg), self.max_model_len)

    def _spec_decoder(self, config: EngineConfig) -> SpecDecoder | None:
        spec = config.speculative
        if spec is None:
            return None
        cost = None
        if spec.adaptive:
            counts = profiled_counts(spec.num_speculative_tokens,
                                     min(config.scheduler.max_num_batched_tokens, self.max_model_len))
            cost, _ = step_time_cache.measured(
                self._profile_key("spec-step-cost", {"counts": counts}),
                lambda: _quietly(lambda: profile_step_cost(self.runner, counts)),
                lambda c: {"tokens": c.tokens.tolist(), "seconds": c.seconds.tolist()},
                lambda d: StepCost(np.asarray(d["tokens"], dtype=np.float64), np.asarray(d["seconds"],
                                                                                         dtype=np.float64)))
            log.info("speculative decoding (%s, up to %d drafts): step cost %s", spec.method,
                     spec.num_speculative_tokens, ", ".join(f"{int(n)}: {s * 1e3:.1f} ms"
                                                            for n, s in zip(cost.tokens, cost.seconds, strict=True)))
        return SpecDecoder(spec, self.max_model_len, cost)

    def profile_speed(self) -> StepSpeed:
        """Time this engine's steps (a second or two), so that a server can predict its deadlines."""
        sc = self.config.scheduler
        passes = speed_passes(sc.max_num_batched_tokens, sc.max_num_seqs, self.num_blocks, self.max_model_len,
                              self.runner.block_size)
        speed, stored = step_time_cache.measured(
            self._profile_key("step-speed", asdict(passes)),
            lambda: _quietly(lambda: profile_speed(self.runner, passes)),
            asdict, lambda d: StepSpeed(*(tuple(d[f]) for f in ("prompt_tokens", "prompt_s", "decode_rows",
                                                                 "decode_s"))))
        if stored:
            profile_step_cost(self.runner, [1, 16])  # the profile's warm-up: first passes create kernels
        self.meter.speed = SpeedTracker(speed)
        startup.info("step times%s: %s", " (as measured by an earlier start with this key)" if stored else "",
                     speed.describe())
        return speed

    def _profile_key(self, kind: str, measured: dict) -> str:
        return step_time_cache.profile_key(kind, self.config, self.block_key_extra[0], measured)

    @property
    def num_blocks(self) -> int:
        return self.scheduler.kv.pool.num_blocks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)
        self.meter.num_prompt_tokens += request.num_prompt_tokens

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self.scheduler.abort(rid)
            if self.structured is not None:
                self.structured.drop(rid)
            if request is not None and self.spec is not None:
                self.spec.finish(request, request.status.completed)

    def pause(self, request_id: str) -> Request | None:
        """Hold a decoding request still, KV and all, to be moved to another engine (None: it is not
        decoding now). A grammar's matcher needs nothing moved: the other engine's catches up on
        the output so far."""
        return self.scheduler.pause(request_id)

    def resume(self, request_id: str) -> bool:
        return self.scheduler.resume(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def request_ids(self) -> list[str]:
        """The ids of the requests the engine holds: every one not finished yet."""
        return list(self.scheduler.requests)

    def take_kv_events(self) -> list[BlockEvent]:
        """The prefix cache's changes since the last call, for whoever mirrors it (a router's index)."""
        return self.scheduler.take_kv_events()

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        self.runner.forget(sched.freed_request_ids)
        t1 = time.perf_counter()
        if sched.is_empty:
            if self.connector.busy():  # KV on its way in: wait for it rather than spin
                self.connector.wait(0.005)
            self.meter.idle(t1 - t0)
            return []
        logged = self.meter.scheduled(sched)
        result, errors = self._execute_isolating_failures(sched)
        t2 = time.perf_counter()
        outputs = self._fail(sched, errors) if errors else []
        # What this step computed for each request beyond its own tokens (drafts), and the prompt work in
        # it: a decode with drafts computes several tokens too, but it is no prompt work.
        drafts: dict[str, int] = {}
        prompt_tokens = 0
        for s in sched.scheduled:
            own = s.num_new_tokens
            if s.request.spec_token_ids:
                drafts[s.request.request_id] = len(s.request.spec_token_ids)
                own -= len(s.request.spec_token_ids)
            if own > 1:
                prompt_tokens += own
        if result.prompt_logprobs:
            for s in sched.scheduled:
                s.request.prompt_logprobs.update(result.prompt_logprobs.get(s.request.request_id, []))
        changed = self.scheduler.update_from_output(sched, result.sampled)
        for r, new in changed:
            prompt_lps = None
            if r.sampling_params.prompt_logprobs is not None and not r.prompt_logprobs_sent and new and \
                    len(r.prompt_logprobs) == r.num_prompt_tokens - 1:  # scored here, every position
                prompt_lps = [r.prompt_logprobs[p] for p in range(1, r.num_prompt_tokens)]
                r.prompt_logprobs, r.prompt_logprobs_sent = {}, True
            if self.structured is not None:
                self.structured.advance(r.request_id, new)
                if r.is_finished:
                    self.structured.drop(r.request_id)
            lps = result.logprobs.get(r.request_id)
            outputs.append(EngineCoreOutput(
                r.request_id, new, lps[:len(new)] if lps else [], r.status.finish_reason,
                r.stop_reason, r.num_cached_tokens, r.num_preemptions, r.scheduled_time, r.first_token_time,
                r.finish_time, prompt_logprobs=prompt_lps))
        t3 = time.perf_counter()
        step_s = t3 - t0
        self.meter.record(sched, logged, prompt_tokens, sum(len(new) for _, new in changed), t1 - t0, t3 - t2,
                          result.timings, step_s, t0)
        if self.spec is not None:
            self._speculate(sched, result.sampled, drafts, errors, prompt_tokens, step_s)
        return outputs

    def _speculate(self, sched: SchedulerOutput, sampled: dict[str, list[int]], drafts: dict[str, int],
                   errors: dict[str, str], prompt_tokens: int, step_s: float) -> None:
        """Count what was verified, let finished requests go, and propose for the next step."""
        spec = self.spec
        assert spec is not None
        spec.observe_step(sched.total_num_tokens, sum(drafts.values()), prompt_tokens, step_s)
        for s in sched.scheduled:
            rid = s.request.request_id
            if rid in sampled:
                spec.verified(rid, drafts.get(rid, 0), sampled[rid])
            if s.request.is_finished or rid in errors:
                spec.finish(s.request, s.request.status.completed)
        # A grammar-constrained request gets no drafts: they would be verified without its mask.
        decoding = [r for r in self.scheduler.running if r.status == RequestStatus.RUNNING
                    and r.num_tokens - r.num_computed_tokens == 1 and r.sampling_params.structured is None]
        proposed = spec.propose(decoding, self.scheduler.num_waiting_prompt_tokens(),
                                self.config.scheduler.max_num_batched_tokens)
        for request, drafts in zip(decoding, proposed, strict=True):
            if drafts:
                request.spec_token_ids = drafts

    def _execute_isolating_failures(self, sched: SchedulerOutput) -> tuple[RunnerOutput, dict[str, str]]:
        """Run the step; when it raises, find the requests that make it fail by running halves of it
        (each half is a valid step on its own) and fail only those: everyone else's tokens are the
        ones they would have had without them (a seeded request's noise is a function of its seed
        and position, so a retried one samples the same tokens)."""
        try:
            return self.runner.execute(sched), {}
        except GroupFailed:  # not one request's fault: the group's ranks are out of step
            raise
        except Exception as e:
            log.error("engine step of %d requests failed (%s: %s); isolating the cause", len(sched.scheduled),
                      type(e).__name__, e)
        merged = RunnerOutput({}, {}, StepTimings())
        errors: dict[str, str] = {}
        pending = [sched.scheduled]
        while pending:
            items = pending.pop()
            try:
                part = self.runner.execute(SchedulerOutput(items, connector_meta=self.connector.build_step(items)))
            except Exception as e:
                if len(items) == 1:
                    errors[items[0].request.request_id] = f"engine error: {type(e).__name__}: {e}"
                else:
                    pending += [items[:len(items) // 2], items[len(items) // 2:]]
                continue
            merged.sampled.update(part.sampled)
            merged.logprobs.update(part.logprobs)
            merged.prompt_logprobs.update(part.prompt_logprobs)
        return merged, errors

    def _fail(self, sched: SchedulerOutput, errors: dict[str, str]) -> list[EngineCoreOutput]:
        """Finish the failing requests with an error and drop them from the step. Their blocks that
        this step was to fill leave the prefix cache, and a request that shared one of them within
        the step read KV that was never written: it is undone and computed again (preempted), which
        loses nothing."""
        failed = {s.request.request_id: s.request for s in sched.scheduled if s.request.request_id in errors}
        unwritten = {b for r in failed.values() for b in self.scheduler.kv.uncache_uncomputed(r)}
        redo: dict[str, Request] = {}
        grew = True
        while grew:  # sharing is transitive: whoever read a redone request's new blocks is redone too
            grew = False
            for s in sched.scheduled:
                rid = s.request.request_id
                if rid not in failed and rid not in redo and unwritten.intersection(s.block_ids):
                    redo[rid] = s.request
                    unwritten |= set(self.scheduler.kv.uncache_uncomputed(s.request))
                    grew = True
        sched.scheduled = [s for s in sched.scheduled if s.request.request_id not in failed | redo.keys()]
        for rid in redo:
            self.connector.reset(rid)
            self.scheduler.requeue(rid)
        outputs = []
        for rid, request in failed.items():
            log.error("request %s failed: %s", rid, errors[rid])
            self.scheduler.fail(rid)
            if self.structured is not None:
                self.structured.drop(rid)
            outputs.append(EngineCoreOutput(rid, [], finish_reason="error", num_cached_tokens=request.num_cached_tokens,
                                            finish_time=request.finish_time, error=errors[rid]))
        return outputs

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def check_alive(self) -> None:
        """GroupFailed if a rank of its worker group has gone (nothing to check without a group)."""
        if self.runner.comm is not None:
            self.runner.comm.check_alive()

    def close(self) -> None:
        """Stop the connector's threads (the store flushes what it was saving) and the worker group."""
        self.connector.close()
        if self.runner.comm is not None:
            self.runner.comm.close()
