"""Token-budget scheduler: continuous batching, chunked prefill and preemption, with no phases.

Every step each request gets a number of new tokens to compute. A running request's prompt chunk
and another's decode token share one forward pass. Running requests are served first (in
arrival order), so a long prompt never stalls anyone's stream; waiting requests fill what budget
is left. When the pool runs dry the newest running request is preempted (its blocks are freed and
it is recomputed later), which always lets the oldest one progress: no deadlock, no OOM. A waiting
prompt starts only when the pool could hold all of it (or nobody runs), so preemption is left to
replies that outgrow the pool, not prompts started too early.

KV that comes from outside the pool (a store hit, a disaggregated prefill's output) comes through
the KV connector: the scheduler asks it how many tokens beyond the pool's prefix hits it can bring,
allocates blocks for them, and parks the request in `loading` until the connector says they landed.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tandem.config import CacheConfig, SchedulerConfig
from tandem.engine.connectors.base import KVConnector
from tandem.engine.fair_queue import FairQueue, order_key
from tandem.engine.request import Request, RequestStatus
from tandem.engine.step import ScheduledRequest, SchedulerOutput, SchedulerStats
from tandem.engine.tenant_shares import TenantShares
from tandem.kv.block_pool import BlockEvent
from tandem.kv.manager import KVCacheManager


@dataclass
class _Step:
    """What one schedule() call has handed out so far."""

    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)
    out: SchedulerOutput = field(default_factory=SchedulerOutput)

    def add(self, request: Request, num_new: int) -> None:
        self.scheduled[request.request_id] = self.scheduled.get(request.request_id, 0) + num_new
        self.budget -= num_new

    def remove(self, request: Request) -> None:
        self.budget += self.scheduled.pop(request.request_id, 0)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, connector: KVConnector | None = None, key_extra: tuple = ()) -> None:
        self.config = scheduler_config
        self.max_model_len = max_model_len
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 cache_config.prefix_caching_hash_algo, cache_config.enable_kv_events, key_extra)
        self.connector = connector or KVConnector()
        self.waiting = FairQueue()
        self.running: list[Request] = []
        # Holding blocks while the connector brings their KV in (WAITING_FOR_KV): no seat, no steps.
        self.loading: dict[str, Request] = {}
        # Their KV landed: they hold their blocks already and need only a seat.
        self._ready: deque[Request] = deque()
        # Finished, but the connector still reads or writes their blocks: freed when it releases them.
        self._held: dict[str, Request] = {}
        # Decoding requests held still, blocks and all, while their KV is copied to another engine
        # (a live migration): no seat, no steps, until resumed or finished.
        self.paused: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.shares = TenantShares(scheduler_config, cache_config.block_size)
        threshold = scheduler_config.long_prefill_token_threshold
        self._chunk_cap = threshold if threshold > 0 and scheduler_config.enable_chunked_prefill else 1 << 62

    # -- queue management ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request at any moment; its blocks are freed at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def requeue(self, request_id: str) -> None:
        """Undo a running request's progress: free its blocks and queue it to be computed again."""
        request = self.requests[request_id]
        self.running.remove(request)
        self._preempt(request)

    def pause(self, request_id: str) -> Request | None:
        """Hold a running request between steps, its KV complete up to its newest token (None: it is
        not decoding: still in its prompt, waiting, or gone). Its drafts are dropped."""
        request = self.requests.get(request_id)
        if (request is None or request.status != RequestStatus.RUNNING or request_id in self.paused
                or request.num_tokens - request.num_computed_tokens != 1):
            return None
        self.running.remove(request)
        request.spec_token_ids = []
        self.paused[request_id] = request
        return request

    def resume(self, request_id: str) -> bool:
        """A paused request decodes on (it keeps its blocks and waits only for a seat)."""
        request = self.paused.pop(request_id, None)
        if request is None:
            return False
        request.status = RequestStatus.WAITING
        self._ready.append(request)
        return True

    def fail(self, request_id: str) -> Request | None:
        """Finish a request the engine could not run (finish reason "error"); its blocks are freed."""
        request = self.requests.get(request_id)
        if request is not None:
            self._finish(request, RequestStatus.FINISHED_ERROR)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if self.paused.pop(request.request_id, None) is not None:
            pass
        elif request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self._ready:
            self._ready.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_KV:
            del self.loading[request.request_id]
        request.status = status
        request.finish_time = time.monotonic()
        del self.requests[request.request_id]
        if request.retain_kv_as is not None and status in (RequestStatus.FINISHED_STOPPED,
                                                           RequestStatus.FINISHED_LENGTH):
            self.kv.retain(request.retain_kv_as, request)
        if self.connector.request_finished(request, self.kv.get_block_ids(request.request_id)):
            self._held[request.request_id] = request
        else:
            self.kv.free(request)

    def num_waiting_prompt_tokens(self) -> int:
        """Prompt tokens (and preempted requests' recompute) still to compute here: the queue a new
        prompt waits behind. KV that is loading is not computed, so it does not count."""
        return sum(r.num_tokens - r.num_computed_tokens for rid, r in self.requests.items()
                   if rid not in self.loading and self._is_prompt_work(r))

    def num_decoding(self) -> int:
        return sum(not self._is_prompt_work(r) for r in self.running)

    def take_kv_events(self) -> list[BlockEvent]:
        """The prefix cache's changes since the last call (recorded when KV events are enabled)."""
        return self.kv.pool.take_events()

    def has_unfinished(self) -> bool:
        # A request waiting for its KV needs no steps, unless the connector's work finishes by itself.
        return len(self.requests) > len(self.loading) + len(self.paused) or self.connector.busy()

    # -- KV from outside the pool ---------------------------------------------------------------
    def _start_load(self, request: Request, hits: list, num_hit_tokens: int, num_external: int) -> bool:
        """Blocks for the pool's hits plus what the connector brings; the request waits for it."""
        if self.kv.allocate_slots(request, num_external, hits, defer_caching=True) is None:
            return False
        self._admitted(request, num_hit_tokens)
        request.status = RequestStatus.WAITING_FOR_KV
        self.loading[request.request_id] = request
        self.connector.on_allocated(request, self.kv.get_block_ids(request.request_id), num_hit_tokens, num_external)
        return True

    def _collect_transfers(self) -> None:
        finished = self.connector.take_finished()
        for rid, num_loaded in finished.loads.items():
            request = self.loading.pop(rid, None)
            if request is None:
                continue  # aborted meanwhile
            request.num_computed_tokens += num_loaded
            # Blocks past what landed (a load cut short) are computed here like any other.
            self.kv.cache_blocks(request, request.num_computed_tokens)
            self.connector.on_load_finished(request, num_loaded)
            request.status = RequestStatus.WAITING
            self._ready.append(request)
        for rid in finished.released:
            request = self._held.pop(rid, None)
            if request is not None:
                self.kv.free(request)

    # -- the step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._collect_transfers()
        step = _Step(self.config.max_num_batched_tokens)
        while self._ready and len(self.running) < self.config.max_num_seqs:
            request = self._ready.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        # Running requests past their prompt first, oldest first: one token each (plus drafts), so
        # no prompt, however long, ever stalls a stream. Drafts get only the budget left once every
        # stream has its own token.
        draft_budget: int | None = None  # counted on the first request with drafts: most steps have none
        running = RequestStatus.RUNNING
        for request in list(self.running):
            if step.budget <= 0:
                break
            # Past its prompt: its newest token (plus drafts) is all that is left to compute.
            left = request.num_tokens - request.num_computed_tokens
            num_new = left + len(request.spec_token_ids)
            if request.status != running or left > 1 or num_new <= 0:
                continue
            if request.spec_token_ids:
                if draft_budget is None:
                    draft_budget = step.budget - self.num_decoding()
                num_new = self._fit_drafts(request, min(num_new, 1 + max(draft_budget, 0)))
                draft_budget -= num_new - 1
            num_new = min(num_new, step.budget)
            if self._allocate_or_preempt(request, num_new, step):
                step.add(request, num_new)
        self._schedule_prompts(step)
        # Single-token rows first, as the runner packs them (each group in running order).
        later: list[ScheduledRequest] = []
        for request in self.running:
            n = step.scheduled.get(request.request_id)
            if n:
                (step.out.scheduled if n == 1 else later).append(
                    ScheduledRequest(request, n, self.kv.block_ids(request.request_id)))
        step.out.scheduled += later
        step.out.decodes_first = True
        if step.out.scheduled:
            step.out.connector_meta = self.connector.build_step(step.out.scheduled)
        step.out.freed_request_ids = self.kv.take_freed()
        return step.out

    def _schedule_prompts(self, step: _Step) -> None:
        """Prompt chunks of running requests and new admissions, shared between tenants: the tenant
        with the least virtual time goes next, each up to its cap (tenant_shares.py: held to the
        contended chunk while another tenant is or was lately here)."""
        partial: dict[str | None, deque[Request]] = {}
        weights: dict[str | None, float] = {}
        for request in self.running:
            weights[request.tenant] = request.tenant_weight
            if request.request_id not in step.scheduled and self._is_prompt_work(request):
                partial.setdefault(request.tenant, deque()).append(request)
        active = set(partial) | set(self.waiting.tenants())
        for tenant in active - set(partial):
            weights[tenant] = self.waiting.head(tenant).tenant_weight  # type: ignore[union-attr]
        self.waiting.sync_active(active)
        caps = self.shares.caps(weights)
        admitting = True  # a waiting head that does not fit stops admissions: nobody overtakes it for blocks
        while step.budget > 0 and active:
            tenant = min(active, key=self.waiting.vtime)
            queue = partial.get(tenant)
            request = queue.popleft() if queue else None
            if request is not None and request.status != RequestStatus.RUNNING:
                continue  # preempted meanwhile: it waits in the queue now
            if request is None:
                request = self.waiting.head(tenant)
                if request is None or not admitting or len(self.running) >= self.config.max_num_seqs:
                    active.discard(tenant)
                    continue
            if caps[tenant] <= 0:
                active.discard(tenant)
                continue
            num_new = self._schedule_prompt(request, min(caps[tenant], step.budget), step)
            caps[tenant] -= num_new
            if num_new:
                self.waiting.charge(tenant, num_new, request.tenant_weight)
            elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                admitting = False

    def _schedule_prompt(self, request: Request, cap: int, step: _Step) -> int:
        """Schedule one prompt chunk of at most cap tokens; the number scheduled (0: it did not fit)."""
        if request.status == RequestStatus.RUNNING:
            num_new = min(self._num_new(request), cap, self._chunk_cap)
            if not self._allocate_or_preempt(request, num_new, step):
                return 0
            step.add(request, num_new)
            return num_new
        hits, num_hit_tokens = [], 0
        if request.num_computed_tokens == 0 and not request.wants_prompt_logprobs:
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_external = self.connector.num_loadable_tokens(request, num_hit_tokens)
            if num_external:
                if self._start_load(request, hits, num_hit_tokens, num_external):
                    self.waiting.pop(request.tenant)  # it is its tenant's head
                return 0
        if self.running and not self.kv.could_hold(request, hits):
            # Started now, its later chunks would run the pool dry and be preempted (their KV thrown
            # away and computed again): it waits until the running requests leave room for all of it.
            # Alone, it starts whatever its size.
            return 0
        num_new = min(request.num_tokens - request.num_computed_tokens - num_hit_tokens, self._chunk_cap)
        if num_new > cap:
            if not self.config.enable_chunked_prefill:
                return 0
            num_new = cap
        if self.kv.allocate_slots(request, num_new, hits, num_lookahead_tokens=self.config.num_lookahead_tokens) \
                is None:
            return 0
        self.waiting.pop(request.tenant)  # it is its tenant's head
        self._admitted(request, num_hit_tokens)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        step.add(request, num_new)
        return num_new

    def _admitted(self, request: Request, num_hit_tokens: int) -> None:
        if request.scheduled_time is None:  # first admission, not a resume
            request.num_cached_tokens = num_hit_tokens
            self.kv.record_prefix_lookup(request, num_hit_tokens)
            request.scheduled_time = time.monotonic()
        request.num_computed_tokens += num_hit_tokens

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _Step) -> bool:
        """Slots for a running request, preempting the least important running request (lowest
        priority, newest) while the pool is dry; False if that was the request itself."""
        while self.kv.allocate_slots(request, num_new, num_lookahead_tokens=self.config.num_lookahead_tokens) is None:
            victim = max(self.running, key=order_key)
            self.running.remove(victim)
            step.remove(victim)
            self._preempt(victim)
            step.out.num_preempted += 1
            if victim is request:
                return False
        return True

    def _fit_drafts(self, request: Request, num_new: int) -> int:
        """Keep the drafts that fit in num_new tokens and in free blocks: a draft never preempts
        anyone (the request then runs its own token alone). Returns the tokens to schedule."""
        del request.spec_token_ids[num_new - 1:]
        if request.spec_token_ids and self.kv.allocate_slots(request, num_new) is None:
            request.spec_token_ids.clear()
            return 1
        return num_new

    @staticmethod
    def _num_new(request: Request) -> int:
        return request.num_tokens + len(request.spec_token_ids) - request.num_computed_tokens

    @staticmethod
    def _is_prompt_work(request: Request) -> bool:
        """More than the newest token left to compute: a prompt (or a resumed request's recompute)."""
        return request.num_tokens - request.num_computed_tokens > 1

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request)

    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, list[int]]) -> list[tuple[Request, list[int]]]:
        """Advance computed counts, append sampled tokens, finish what stopped; returns each request
        that got tokens this step with the tokens it kept (a stop can cut a multi-token step short)."""
        changed = []
        now = time.monotonic()
        finished = RequestStatus.FINISHED_STOPPED  # this and every status after it
        for item in out.scheduled:
            request = item.request
            if request.status >= finished:  # aborted between schedule and update
                continue
            request.num_computed_tokens += item.num_new_tokens
            tokens = sampled.get(request.request_id)
            if not tokens:
                continue  # a prompt chunk that did not reach the end
            # Accepted drafts (all but the last token) were computed this step: their KV stays. The
            # rejected ones' slots are overwritten by the tokens computed there next.
            request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens + len(tokens) - 1)
            if request.spec_token_ids:
                request.spec_token_ids = []
            if request.first_token_time is None:
                request.first_token_time = now
            kept = tokens
            for i, token in enumerate(tokens):
                request.append_output_token(token)
                status = request.stop_status(token, self.max_model_len)
                if status is not None:
                    self._finish(request, status)
                    kept = tokens[:i + 1]
                    break
            changed.append((request, kept))
        return changed

    def stats(self) -> SchedulerStats:
        usage = self.kv.usage()
        return SchedulerStats(len(self.running), len(self.waiting) + len(self._ready), usage.usage,
                              self.num_preemptions, self.kv.prefix_stats.queries, self.kv.prefix_stats.hits,
                              usage.num_used_blocks, usage.num_blocks, self.num_waiting_prompt_tokens(),
                              self.num_decoding())
