"""One simulated engine instance: the engine's own Scheduler (token budget, chunked prefill,
preemption, prefix caching, the KV connector's loading path) on a virtual clock, with a cost model
in place of the model runner and a token that never stops a request in place of the sampler."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tandem.config import CacheConfig, SchedulerConfig
from tandem.disagg.worker.kv_connectors import KVRecvConnector
from tandem.engine.connectors.multi import MultiConnector
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.engine.step import SchedulerOutput
from tandem.sampling_params import SamplingParams
from tandem.sim.colocation import step_kind
from tandem.sim.cost import CostModel, StepShape
from tandem.sim.speculation import SpecModel
from tandem.sim.store import SimStoreConnector

# What the simulated sampler returns: any id works (requests stop at max_tokens; EOS is ignored).
SIM_TOKEN = 1


class NullReceiver:
    """The KV receiver of a simulated decode instance: the cluster delivers the bytes in time."""

    endpoint = None

    def open(self, request_id: str, block_ids: list[int]) -> None:
        pass

    def close(self, request_id: str) -> None:
        pass


@dataclass
class StepRecord:
    start: float
    duration: float
    scheduled: list[tuple[str, int]]  # (request id, new tokens), in the scheduler's order
    shape: StepShape


@dataclass
class TokenEvent:
    request: Request
    time: float
    num_tokens: int
    finished: bool


def sim_request(request_id: str, prompt: list[int], max_tokens: int, arrival: float, tenant: str | None = None,
                priority: int = 0) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return Request(request_id, prompt, params, eos_token_ids=(), arrival_time=arrival, tenant=tenant,
                   priority=priority)


@dataclass
class SimInstance:
    name: str
    role: str  # colocated | prefill | decode
    cost: CostModel
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    max_model_len: int
    record_steps: bool = False
    store: SimStoreConnector | None = None  # the tiered store's door, when the deployment has one
    spec: SpecModel | None = None  # speculative decoding's drafts and acceptance, when it is on
    seed: int = 0  # of the acceptance draws
    steps: list[StepRecord] = field(default_factory=list)
    busy_s: float = 0.0

    def __post_init__(self) -> None:
        num_blocks = max(self.cost.kv_capacity_tokens() // self.cache_config.block_size, 1)
        self.recv = KVRecvConnector(NullReceiver(), self.cache_config.block_size, self.name)  # type: ignore[arg-type]
        # As in the engine: a decode instance's expected prompts arrive from their prefill instance
        # first; the store serves everything else.
        connector = self.recv if self.store is None else MultiConnector([self.recv, self.store])
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, num_blocks,
                                   min(self.max_model_len, num_blocks * self.cache_config.block_size), connector)
        self.step_end: float | None = None  # when the step in flight ends at its present speed (None: idle)
        self._step: SchedulerOutput | None = None
        self._sampled: list[str] = []
        self.step_start = 0.0  # when the step in flight began
        self.step_kind = "decode"  # of the step in flight (colocation.py's kinds)
        # The step's work left, in seconds at full speed, as of `_since`; and its present speed (a
        # neighbour's step on the same host slows it).
        self._work_left = 0.0
        self._since = 0.0
        self.speed = 1.0
        self.generation = 0  # bumped whenever step_end moves: an older end event is stale
        self.reserved: list[str] = []  # reservations made by the step in flight, answered at its end
        self._rng = np.random.default_rng(self.seed)
        self._accepted: dict[str, int] = {}  # drafts accepted this step, by request
        self.num_drafts = self.num_accepted = 0

    # -- what the cluster does to it -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def reserve(self, request: Request) -> None:
        """A disaggregated request: its prompt's KV comes from a prefill instance."""
        self.recv.expect(request.request_id)
        self.scheduler.add_request(request)

    def take_reserved(self) -> list[str]:
        return [h.request_id for h in self.recv.take_reserved()]

    def arrived(self, request_id: str) -> bool:
        return self.recv.arrived(request_id, SIM_TOKEN)

    @property
    def load(self) -> int:
        return len(self.scheduler.requests)

    @property
    def worker_id(self) -> str:
        return self.name

    def active_blocks(self) -> int:
        pool = self.scheduler.kv.pool
        return pool.num_blocks - pool.num_free_blocks

    # -- steps ---------------------------------------------------------------------------------------
    def start_step(self, now: float) -> float | None:
        """Schedule a step at `now`; its end time, or None when there is nothing to run."""
        if self.spec is not None:
            self._draft()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return None
        items, sampled = [], []
        self._accepted = {}
        for s in sched.scheduled:
            r = s.request
            samples = r.num_computed_tokens + s.num_new_tokens >= r.num_tokens
            drafted = len(r.spec_token_ids)
            # A verification computes logits for the newest token and every draft.
            items.append((s.num_new_tokens, r.num_computed_tokens, drafted + 1 if drafted else samples))
            if samples:
                sampled.append(r.request_id)
            if drafted and self.spec is not None:
                self._accepted[r.request_id] = self.spec.draw_accepted(self._rng, drafted)
                self.num_drafts += 1
                self.num_accepted += self._accepted[r.request_id]
        shape = StepShape.of(items)
        duration = self.cost.step_time(shape)
        if self.record_steps:
            self.steps.append(StepRecord(now, duration, [(s.request.request_id, s.num_new_tokens)
                                                         for s in sched.scheduled], shape))
        self._step, self._sampled, self.step_start = sched, sampled, now
        self.step_kind = step_kind(shape.num_tokens, shape.num_decode)
        self._work_left, self._since, self.speed = duration, now, 1.0
        self.step_end = now + duration
        self.generation += 1
        return self.step_end

    def _draft(self) -> None:
        """Drafts for the streams past their prompt, as a proposer would offer them."""
        spec = self.spec
        assert spec is not None
        for r in self.scheduler.running:
            if r.num_tokens - r.num_computed_tokens != 1 or r.spec_token_ids or r.sampling_params.max_tokens is None:
                continue
            room = r.sampling_params.max_tokens - r.num_output_tokens - 1
            if room > 0 and self._rng.random() < spec.draft_rate:
                r.spec_token_ids = [SIM_TOKEN] * min(spec.draft_tokens, room)

    def set_speed(self, now: float, speed: float) -> float:
        """Run the step in flight at `speed` from now on; its new end."""
        assert self.step_end is not None
        self._work_left = max(self._work_left - (now - self._since) * self.speed, 0.0)
        self._since, self.speed = now, speed
        self.step_end = now + self._work_left / speed
        self.generation += 1
        return self.step_end

    def finish_step(self, on_tokens: Callable[[TokenEvent], None]) -> SchedulerOutput:
        sched, now = self._step, self.step_end
        assert sched is not None and now is not None
        self._step, self.step_end = None, None
        self.busy_s += now - self.step_start
        if self.store is not None:
            self.store.step_done()
        changed = self.scheduler.update_from_output(
            sched, {rid: [SIM_TOKEN] * (1 + self._accepted.get(rid, 0)) for rid in self._sampled})
        for request, kept in changed:
            on_tokens(TokenEvent(request, now, len(kept), request.is_finished))
        return sched
