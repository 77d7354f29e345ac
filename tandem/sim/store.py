"""The tiered KV store in the simulator: block keys in LRU tiers of given capacities and bandwidths
(host memory, disk, a distributed store), shared by the instances that name it, and a connector
whose scheduler half decides by the engine's StoreConnector's own rules (engine/connectors/store.py:
loadable_tokens, unsaved_blocks): save every block a step fills that no tier holds yet
(write-through), load a prompt's next blocks when the store holds them (never the last token), the
request waiting in WAITING_FOR_KV while the bytes cross the tier's bandwidth."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.connectors.base import FinishedTransfers, KVConnector
from tandem.engine.connectors.store import loadable_tokens, unsaved_blocks
from tandem.engine.request import Request
from tandem.engine.step import ScheduledRequest

GIB = 1 << 30


@dataclass
class SimTier:
    name: str
    capacity_blocks: int
    bandwidth: float  # bytes/s a load reads
    latency_s: float = 0.0
    keys: OrderedDict[int, None] = field(default_factory=OrderedDict)
    hits: int = 0

    @classmethod
    def parse(cls, spec: str, block_bytes: float) -> SimTier:
        """NAME:GIB:GBPS[:LATENCY_MS], e.g. host:16:8 or disk:200:2:0.1."""
        parts = spec.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"a store tier is NAME:GIB:GBPS[:LATENCY_MS], got {spec!r}")
        try:
            gib, gbps = float(parts[1]), float(parts[2])
            latency = float(parts[3]) / 1000 if len(parts) == 4 else 0.0
        except ValueError:
            raise ValueError(f"store tier {spec!r}: sizes and speeds are numbers") from None
        if gib <= 0 or gbps <= 0:
            raise ValueError(f"store tier {spec!r}: size and bandwidth must be positive")
        return cls(parts[0], int(gib * GIB // block_bytes), gbps * 1e9, latency)

    def add(self, key: int) -> None:
        self.keys[key] = None
        self.keys.move_to_end(key)
        while len(self.keys) > self.capacity_blocks:
            self.keys.popitem(last=False)


@dataclass
class SimStore:
    tiers: list[SimTier]
    block_bytes: float

    def tier_of(self, key: int) -> SimTier | None:
        return next((t for t in self.tiers if key in t.keys), None)

    def contains(self, key: int) -> bool:
        return self.tier_of(key) is not None

    def num_leading(self, keys: list[int]) -> int:
        n = 0
        for key in keys:
            if not self.contains(key):
                break
            n += 1
        return n

    def save(self, keys: list[int]) -> None:
        for tier in self.tiers:  # write-through
            for key in keys:
                tier.add(key)

    def load(self, keys: list[int]) -> float:
        """Seconds to read these blocks; a hit is promoted into every tier above the one it came from."""
        seconds = 0.0
        for key in keys:
            tier = self.tier_of(key)
            assert tier is not None
            tier.hits += 1
            seconds += self.block_bytes / tier.bandwidth
            for upper in self.tiers[: self.tiers.index(tier) + 1]:
                upper.add(key)
        slowest = max((t.latency_s for t in self.tiers if t.hits), default=0.0)
        return seconds + slowest


class SimStoreConnector(KVConnector):
    """One instance's door to a shared SimStore. `schedule(seconds, fn)` is the simulator's clock:
    fn runs that many seconds from now."""

    def __init__(self, store: SimStore, block_size: int, schedule: Callable[[float, Callable[[], None]], None],
                 on_landed: Callable[[], None]) -> None:
        self.store = store
        self.block_size = block_size
        self.schedule = schedule
        self.on_landed = on_landed
        self._landed: dict[str, int] = {}
        self._loading: set[str] = set()
        self._saved: dict[str, int] = {}
        self._pending: list[int] = []  # filled by the step in flight: stored when it ends
        self.loaded_tokens = 0

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return loadable_tokens(request, num_computed_tokens, self.block_size, self.store.num_leading)

    def on_allocated(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                     num_external_tokens: int) -> None:
        start = num_computed_tokens // self.block_size
        keys = request.block_hashes[start: start + num_external_tokens // self.block_size]
        rid = request.request_id
        self._loading.add(rid)

        def landed() -> None:
            if rid in self._loading:
                self._loading.discard(rid)
                self._landed[rid] = num_external_tokens
                self.on_landed()

        self.schedule(self.store.load(keys), landed)

    def take_finished(self) -> FinishedTransfers:
        out, self._landed = self._landed, {}
        return FinishedTransfers(out)

    def on_load_finished(self, request: Request, num_loaded_tokens: int) -> None:
        self.loaded_tokens += num_loaded_tokens

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._loading.discard(request.request_id)
        self._landed.pop(request.request_id, None)
        self._saved.pop(request.request_id, None)
        return False

    def build_step(self, items: list[ScheduledRequest]) -> None:
        for item in items:
            self._pending += [item.request.block_hashes[i]
                              for i in unsaved_blocks(item, self._saved, self.block_size, self.store.contains)]

    def step_done(self) -> None:
        """The step's blocks are computed: into the store (the engine's saver does this after the step)."""
        self.store.save(self._pending)
        self._pending = []

    def reset(self, request_id: str) -> None:
        self._saved.pop(request_id, None)

    def busy(self) -> bool:
        return bool(self._landed)
