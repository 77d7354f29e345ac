"""Which worker a request goes to: KV-aware (default), least-loaded or round-robin.

`kv` estimates, for each candidate, what the request would cost there: the blocks it would still
have to prefill (its prompt's blocks past the worker's cached overlap, from the PrefixIndex) times
`overlap_weight`, plus the worker's decode load (the KV blocks of the requests it is serving).
Lowest cost wins (or, with a temperature, a softmax draw over the costs). A load guard stops one
hot prefix (a shared system prompt) from piling every request onto the worker that holds it: when
the pick already serves more than `guard_ratio` times the candidates' mean requests (plus one), the
least-loaded candidate takes the request instead, and then caches that prefix too.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from tandem.policy.paths import PATH_POLICIES, Slo
from tandem.policy.prefix_index import PrefixIndex

POLICIES = ("kv", "least-loaded", "round-robin")


class RoutedWorker(Protocol):
    """What routing reads of a worker (the router's registry entries and the simulator's instances)."""

    @property
    def worker_id(self) -> str: ...

    @property
    def load(self) -> float: ...


W = TypeVar("W", bound=RoutedWorker)


@dataclass
class RoutingSettings:
    policy: str = "kv"
    overlap_weight: float = 1.0  # one block to prefill costs this many blocks of decode load
    temperature: float = 0.0  # 0: the cheapest; > 0: a softmax draw over normalised costs
    guard_ratio: float = 1.5
    predict_ttl_s: float = 30.0  # the router's own decisions count as cached this long (approximate mode)
    paths: str = "slo"  # how a request's path is chosen (paths.py)
    slo: Slo = field(default_factory=lambda: Slo(2.0, 0.2))

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {self.policy!r}")
        if self.paths not in PATH_POLICIES:
            raise ValueError(f"path policy must be one of {PATH_POLICIES}, got {self.paths!r}")


@dataclass
class Pick(Generic[W]):
    worker: W
    overlap_blocks: int  # of the prompt's full blocks, how many the worker holds (as the index thinks)
    guarded: bool = False  # the load guard overrode the cheapest worker


def least_loaded(workers: Sequence[W]) -> W:
    return min(workers, key=lambda w: (w.load, w.worker_id))


class Router(Generic[W]):
    def __init__(self, settings: RoutingSettings, index: PrefixIndex,
                 active_blocks: Callable[[W], int], rng: random.Random | None = None) -> None:
        self.settings = settings
        self.index = index
        self.active_blocks = active_blocks
        self.rng = rng or random.Random(0)
        self._turns: dict[tuple[str, ...], itertools.count] = {}

    def pick(self, keys: Sequence[int], num_blocks: int, workers: Sequence[W]) -> Pick[W] | None:
        """keys: the prompt's full-block keys; num_blocks: all its blocks (the partial last one too)."""
        if not workers:
            return None
        policy = self.settings.policy
        if policy == "round-robin":  # a turn per pool: picking in one pool does not skip another's
            ordered = sorted(workers, key=lambda w: w.worker_id)
            turn = self._turns.setdefault(tuple(w.worker_id for w in ordered), itertools.count())
            worker = ordered[next(turn) % len(ordered)]
        elif policy == "least-loaded":
            worker = least_loaded(workers)
        else:
            return self._pick_by_cost(keys, num_blocks, workers)
        return Pick(worker, self.index.overlap(worker.worker_id, keys))

    def _pick_by_cost(self, keys: Sequence[int], num_blocks: int, workers: Sequence[W]) -> Pick[W]:
        overlaps = [self.index.overlap(w.worker_id, keys) for w in workers]
        costs = [self.settings.overlap_weight * (num_blocks - o) + self.active_blocks(w)
                 for w, o in zip(workers, overlaps, strict=True)]
        if self.settings.temperature > 0 and len(workers) > 1:
            scale = max(max(costs), 1.0) * self.settings.temperature
            weights = [math.exp(-(c - min(costs)) / scale) for c in costs]
            i = self.rng.choices(range(len(workers)), weights)[0]
        else:
            i = min(range(len(workers)), key=lambda j: (costs[j], workers[j].load, workers[j].worker_id))
        mean = sum(w.load for w in workers) / len(workers)
        if workers[i].load > self.settings.guard_ratio * mean + 1:
            spare = least_loaded(workers)
            if spare is not workers[i]:
                j = list(workers).index(spare)
                return Pick(spare, overlaps[j], guarded=True)
        return Pick(workers[i], overlaps[i])

    def routed(self, worker: W, keys: Sequence[int]) -> None:
        """The request went to the worker: until events say otherwise, its prompt is cached there."""
        self.index.predict(worker.worker_id, keys)
