"""A discrete-event simulation of a whole deployment: colocated instances, disaggregated xPyD, or
both. Each instance runs the engine's scheduler (instance.py); the router's own policies pick the
instances (routing.py's Router over a PrefixIndex fed by the instances' KV events); a disaggregated
request follows the cluster's protocol (reserve on the decode instance, prefill with max_tokens 1,
the KV leaving layer by layer over one link per prefill instance, then admit), each message one hop.

The output is the bench client's RequestRecords, so the metrics are `tandem bench serve`'s own.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.bench.client import RequestRecord
from tandem.config import CacheConfig, SchedulerConfig
from tandem.engine.request import Request
from tandem.kv.hashing import block_keys
from tandem.policy.paths import PATH_POLICIES
from tandem.policy.prefix_index import PrefixIndex
from tandem.policy.routing import Router, RoutingSettings
from tandem.sim.cost import CostModel
from tandem.sim.instance import SIM_TOKEN, SimInstance, TokenEvent, sim_request
from tandem.sim.path_choice import choose_path
from tandem.sim.speculation import SpecModel
from tandem.sim.store import SimStore, SimStoreConnector
from tandem.slo import DEFAULT_SLO, Slo

ROLES = ("colocated", "prefill", "decode")
_SPEC = re.compile(r"(\d+)([CPD])", re.IGNORECASE)


@dataclass(frozen=True)
class Deployment:
    colocated: int = 1
    prefill: int = 0
    decode: int = 0
    routing: str = "least-loaded"
    # How a request with a prefill/decode pair available picks its path, as the router's --path-policy:
    # "slo" predicts each path's TTFT and TPOT and takes the one with the most headroom (path_choice.py),
    # "disaggregated" sends every prompt through the pair.
    path_policy: str = "slo"

    def __post_init__(self) -> None:
        if min(self.colocated, self.prefill, self.decode) < 0:
            raise ValueError("instance counts must not be negative")
        if self.prefill > 0 and self.decode == 0:
            raise ValueError("prefill instances need decode instances to hand their requests to")
        if self.colocated + self.prefill + self.decode == 0:
            raise ValueError("a deployment needs at least one instance")
        if self.path_policy not in PATH_POLICIES:
            raise ValueError(f"the path policy is one of {', '.join(PATH_POLICIES)}, got {self.path_policy!r}")

    @classmethod
    def parse(cls, text: str, routing: str = "least-loaded", path_policy: str = "slo") -> Deployment:
        """"2C", "1P1D", "2P4D", "1P2D1C" (counts of Colocated, Prefill, Decode instances); "1D" alone
        is a decode pool whose prompts arrive with their KV (the planner's decode phase)."""
        compact = text.replace(" ", "")
        parts = _SPEC.findall(compact)
        if not parts or "".join(n + r for n, r in parts).upper() != compact.upper():
            raise ValueError(f"a deployment is like '2C', '1P1D' or '1P2D1C', got {text!r}")
        counts = {"C": 0, "P": 0, "D": 0}
        for n, r in parts:
            counts[r.upper()] += int(n)
        return cls(counts["C"], counts["P"], counts["D"], routing, path_policy)

    def describe(self) -> str:
        disagg = (f"{self.prefill}P" if self.prefill else "") + (f"{self.decode}D" if self.decode else "")
        return disagg + (f"{self.colocated}C" if self.colocated else "")

    @property
    def is_disaggregated(self) -> bool:
        return self.decode > 0

    @property
    def decode_alone(self) -> bool:
        """Only decode instances: a decode pool studied alone, its prompts arriving with their KV."""
        return self.decode > 0 and not (self.prefill or self.colocated)


@dataclass
class SimTurn:
    prompt: list[int]  # this turn's new tokens (a later turn adds them to the conversation so far)
    max_tokens: int
    category: str = "default"


@dataclass
class SimSession:
    turns: list[SimTurn]
    start: float  # seconds after the run's start
    think_times: list[float] = field(default_factory=list)  # before each later turn (the bench's own draws)


@dataclass
class _Flight:
    """One request's life, as the client sees it."""

    record: RequestRecord
    times: list[float] = field(default_factory=list)  # each token's arrival at the client
    next_turn: Callable[[], None] | None = None  # the session's next turn, sent after this one's last token


@dataclass
class _Link:
    """One prefill instance's way out: transfers queue on it in step order."""

    free_at: float = 0.0


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration: float
    instances: list[SimInstance]


class ClusterSim:
    def __init__(self, deployment: Deployment, costs: dict[str, CostModel], scheduler_config: SchedulerConfig,
                 cache_config: CacheConfig, max_model_len: int, record_steps: bool = False,
                 store: SimStore | None = None, joins_at: dict[str, float] | None = None,
                 slo: Slo = DEFAULT_SLO, spec: SpecModel | None = None, instances_per_host: int = 0) -> None:
        """slo: what the path choice scores against; spec: speculative decoding on every instance;
        instances_per_host: how many instances share a host's cores and memory, in the pools' order
        (0: all of them, as a deployment on one machine)."""
        self.deployment = deployment
        self.slo, self.spec = slo, spec
        # Instances (by name) that join late, as a worker the planner starts does: the router sends
        # them nothing before.
        self.joins_at = joins_at or {}
        self.cache_config = cache_config
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.pools: dict[str, list[SimInstance]] = {}
        for role, n in (("colocated", deployment.colocated), ("prefill", deployment.prefill),
                        ("decode", deployment.decode)):
            cost = costs.get(role) or costs.get("colocated")
            if n and cost is None:
                raise ValueError(f"no cost model for the {role} instances")
            self.pools[role] = [self._instance(f"{role[0]}{i}", role, cost, scheduler_config, cache_config,  # type: ignore[arg-type]
                                               max_model_len, record_steps, store) for i in range(n)]
        self.instances = [w for pool in self.pools.values() for w in pool]
        per_host = instances_per_host or len(self.instances)
        self._host: dict[str, list[SimInstance]] = {}
        for i in range(0, len(self.instances), per_host):
            host = self.instances[i:i + per_host]
            for w in host:
                self._host[w.name] = host
        self._links = {w.name: _Link() for w in self.instances}
        self.hop_s = max(w.cost.hop_s for w in self.instances)
        self._kv_routing = deployment.routing == "kv"
        self.index = PrefixIndex(clock=lambda: self.now)
        self.router = Router(RoutingSettings(policy=deployment.routing), self.index,
                             lambda w: w.active_blocks())  # type: ignore[arg-type,attr-defined]
        self._flights: dict[str, _Flight] = {}  # by engine request id
        self._prefilling: dict[str, tuple[SimInstance, float]] = {}  # rid -> (decode instance, transfer done)
        # Reserved, its prefill not yet sent (no prefill instance: a decode pool alone).
        self._awaiting_prefill: dict[str, tuple[Request, SimInstance | None]] = {}
        self.records: list[RequestRecord] = []

    def _instance(self, name: str, role: str, cost: CostModel, sched: SchedulerConfig, cache: CacheConfig,
                  max_model_len: int, record_steps: bool, store: SimStore | None) -> SimInstance:
        holder: list[SimInstance] = []
        door = None if store is None else SimStoreConnector(
            store, cache.block_size, lambda dt, fn: self.at(self.now + dt, fn), lambda: self._kick(holder[0]))
        worker = SimInstance(name, role, cost, sched, cache, max_model_len, record_steps, door, self.spec,
                             seed=sum(map(ord, name)))
        holder.append(worker)
        return worker

    # -- the event loop ----------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, sessions: list[SimSession]) -> SimResult:
        index = itertools.count()
        for s_i, session in enumerate(sessions):
            self.at(session.start, lambda s_i=s_i, session=session: self._arrive(session, s_i, 0, [], index))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
        for f in self._flights.values():
            f.record.error = "never finished (the pools could not hold it)"
            self.records.append(f.record)
        duration = max((r.start + r.latency for r in self.records if r.success), default=0.0)
        return SimResult(sorted(self.records, key=lambda r: r.index), max(duration, 1e-9), self.instances)

    # -- arrivals and routing ----------------------------------------------------------------------
    def _arrive(self, session: SimSession, s_i: int, t_i: int, history: list[int], index: itertools.count) -> None:
        turn = session.turns[t_i]
        prompt = history + turn.prompt
        i = next(index)
        rid = f"s{s_i}t{t_i}"
        record = RequestRecord(i, s_i, t_i, turn.category, len(prompt), turn.max_tokens, start=self.now)
        request = sim_request(rid, prompt, turn.max_tokens, self.now)
        flight = _Flight(record)
        if t_i + 1 < len(session.turns):
            answer = [SIM_TOKEN] * turn.max_tokens
            think = session.think_times[t_i] if t_i < len(session.think_times) else 0.0
            flight.next_turn = lambda: self.at(self.now + think,
                                               lambda: self._arrive(session, s_i, t_i + 1, prompt + answer, index))
        self._flights[rid] = flight
        keys = block_keys(prompt, self.cache_config.block_size, self.cache_config.prefix_caching_hash_algo, (),
                          None) if self._kv_routing else []
        num_blocks = -(-len(prompt) // self.cache_config.block_size)
        d = self.deployment
        up = {role: [w for w in pool if self.joins_at.get(w.name, 0.0) <= self.now]
              for role, pool in self.pools.items()}
        if d.decode_alone and up["decode"]:  # the prompts arrive with their KV
            self._send_disaggregated(request, None, self._pick(keys, num_blocks, up["decode"]), keys)
            return
        # Picked as the router picks (dispatch.py's options): each pool once, the whole-request
        # candidates only where they could be taken.
        decode = self._pick(keys, num_blocks, up["decode"]) if up["decode"] else None
        prefill = self._pick(keys, num_blocks, up["prefill"] + up["colocated"]) \
            if decode is not None and (up["prefill"] or up["colocated"]) else None
        if prefill is not None and d.path_policy == "disaggregated":
            self._send_disaggregated(request, prefill, decode, keys)  # type: ignore[arg-type]
            return
        whole = [w for w in (self._pick(keys, num_blocks, up["colocated"]) if up["colocated"] else None, decode)
                 if w is not None]
        if prefill is None:
            self._run_whole(whole[0], request, keys)
            return
        option = choose_path(len(prompt), turn.max_tokens, whole, prefill, decode, self.slo,
                             lambda w: max(self._links[w.name].free_at - self.now, 0.0))
        if option.path == "disaggregated":
            self._send_disaggregated(request, option.prefill, option.decode, keys)  # type: ignore[arg-type]
        else:
            self._run_whole(option.decode, request, keys)  # type: ignore[arg-type]

    def _run_whole(self, worker: SimInstance, request: Request, keys: list[int]) -> None:
        """On one instance: a colocated one, or a decode instance that prefills the prompt itself."""
        self._routed(keys, worker)
        self.at(self.now + self.hop_s, lambda: self._add(worker, request))

    def _send_disaggregated(self, request: Request, prefill: SimInstance | None, decode: SimInstance,
                            keys: list[int]) -> None:
        self._routed(keys, decode, prefill)
        self._awaiting_prefill[request.request_id] = (request, prefill)
        self.at(self.now + self.hop_s, lambda: self._reserve(decode, request))

    def _routed(self, keys: list[int], *workers: SimInstance | None) -> None:
        if self._kv_routing:
            for w in workers:
                if w is not None:
                    self.router.routed(w, keys)  # type: ignore[arg-type]

    def _pick(self, keys: list[int], num_blocks: int, pool: list[SimInstance]) -> SimInstance:
        if not pool:
            raise ValueError("no instance of the deployment can serve this request yet")
        pick = self.router.pick(keys, num_blocks, pool)  # type: ignore[arg-type]
        assert pick is not None
        worker: SimInstance = pick.worker  # type: ignore[assignment]
        return worker

    def _add(self, worker: SimInstance, request: Request) -> None:
        worker.add(request)
        self._kick(worker)

    # -- disaggregation ----------------------------------------------------------------------------
    def _reserve(self, decode: SimInstance, request: Request) -> None:
        decode.reserve(request)
        self._kick(decode)

    def _on_reserved(self, decode: SimInstance, rid: str) -> None:
        request, prefill = self._awaiting_prefill.pop(rid)
        if prefill is None:  # a decode pool alone: the prompt's KV arrives over the link
            nbytes = request.num_prompt_tokens * decode.cost.kv_bytes_per_token
            self._prefilling[rid] = (decode, self.now + decode.cost.transfer_time(nbytes))
            self._prefilled(rid)
            return
        copy = sim_request(rid, list(request.prompt_token_ids), 1, self.now)
        self._prefilling[rid] = (decode, 0.0)
        # Reserved goes back to the router, Prefill on to the prefill instance: two hops.
        self.at(self.now + 2 * self.hop_s, lambda: self._add(prefill, copy))

    def _ship(self, worker: SimInstance, start: float, duration: float, rid: str, num_tokens: int) -> None:
        """A prefill step's KV for one request: layer i leaves once layer i is computed, behind what
        this instance is still sending."""
        cost = worker.cost
        nbytes = num_tokens * cost.kv_bytes_per_token
        latency = cost.transfer_time(0)
        wire = cost.transfer_time(nbytes) - latency
        link = self._links[worker.name]
        first_layer_done = start + duration / cost.num_layers
        link.free_at = max(link.free_at, first_layer_done) + wire
        # The last layer cannot leave before it is computed.
        done = max(link.free_at, start + duration + wire / cost.num_layers) + latency
        decode, prev = self._prefilling[rid]
        self._prefilling[rid] = (decode, max(prev, done))

    def _prefilled(self, rid: str) -> None:
        decode, done = self._prefilling.pop(rid)
        flight = self._flights[rid]
        # The worker says Prefilled once the transfer landed; the router sends the first token on
        # to the client and Admit to the decode instance.
        self.at(max(done, self.now) + self.hop_s, lambda: self._first_token(flight))
        self.at(max(done, self.now) + 2 * self.hop_s, lambda: self._admit(decode, rid))

    def _first_token(self, flight: _Flight) -> None:
        flight.times.append(self.now)

    def _admit(self, decode: SimInstance, rid: str) -> None:
        if decode.arrived(rid):
            self._kick(decode)

    # -- steps -------------------------------------------------------------------------------------
    def _kick(self, worker: SimInstance) -> None:
        if worker.step_end is not None:
            return
        end = worker.start_step(self.now)
        # A worker answers Reserved after the step whose schedule() allocated the blocks (it reports
        # between steps), so a busy decode worker costs a reservation the rest of its step and one more.
        reserved = worker.take_reserved()
        if end is None:
            if reserved:
                self.at(self.now, lambda: [self._on_reserved(worker, rid) for rid in reserved])
            return
        worker.reserved = reserved
        self._end_at(worker)
        self._reprice(worker)

    def _end_at(self, worker: SimInstance) -> None:
        """The step's end event at its present speed; one from before a re-pricing is stale."""
        generation, end = worker.generation, worker.step_end
        assert end is not None
        self.at(end, lambda: self._step_done(worker) if worker.generation == generation else None)

    def _reprice(self, worker: SimInstance) -> None:
        """A step started or ended on worker's host: every step in flight there runs at the speed its
        neighbours' steps leave it (colocation.py)."""
        host = self._host[worker.name]
        if not any(w.cost.neighbours for w in host):
            return
        busy = [w for w in host if w.step_end is not None]
        for w in busy:
            rule = w.cost.neighbours
            factor = rule.factor(w.step_kind, [o.step_kind for o in busy if o is not w]) if rule else 1.0
            if 1.0 / factor != w.speed:
                w.set_speed(self.now, 1.0 / factor)
                self._end_at(w)

    def _step_done(self, worker: SimInstance) -> None:
        start = worker.step_start
        sched = worker.finish_step(lambda ev: self._tokens(worker, ev))
        reserved, worker.reserved = worker.reserved, []
        for rid in reserved:
            self._on_reserved(worker, rid)
        if worker.role != "decode":
            # Any prefill-capable instance may be prefilling for a decode instance: its KV leaves, and a
            # finished prefill goes on.
            for s in sched.scheduled:
                rid = s.request.request_id
                if rid in self._prefilling:
                    self._ship(worker, start, self.now - start, rid, s.num_new_tokens)
                    if s.request.is_finished:
                        self._prefilled(rid)
        if self._kv_routing:
            self.index.apply(worker.name, worker.scheduler.kv.pool.take_events())
        self._reprice(worker)
        self._kick(worker)

    def _tokens(self, worker: SimInstance, ev: TokenEvent) -> None:
        rid = ev.request.request_id
        if rid in self._prefilling:
            return  # the prefill's token reaches the client through _prefilled
        flight = self._flights.get(rid)
        if flight is None:
            return
        # Tokens stream back through the router (or the API process): one hop.
        flight.times.extend([self.now + self.hop_s] * ev.num_tokens)
        if ev.finished:
            self._finish(rid, flight)

    def _finish(self, rid: str, flight: _Flight) -> None:
        del self._flights[rid]
        r = flight.record
        times = flight.times
        r.success = True
        r.status = 200
        r.output_tokens = len(times)
        r.ttft = times[0] - r.start
        r.latency = times[-1] - r.start
        r.itl = [b - a for a, b in zip(times, times[1:], strict=False)]
        self.records.append(r)
        if flight.next_turn is not None:
            self.at(times[-1], flight.next_turn)
