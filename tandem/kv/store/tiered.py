"""The tiers below a worker's pool, searched in order: host memory, then disk, then the distributed
store. A block is saved to every tier (write-through: the host tier serves the next turn, the disk
survives a restart, the distributed tier serves other hosts) and loaded from the first that holds it
and verifies; a hit in a lower tier is copied into the tiers above it, so it is close next time.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.config import StoreSettings
from tandem.kv.store.tier import KVTier, TierStats

GiB = 1 << 30


def open_tiers(settings: StoreSettings, block_nbytes: int, ident: str) -> list[KVTier]:
    """The configured tiers for blocks of block_nbytes. Without a host tier path (an offline engine;
    a server names one per deployment) the file is this process's own, named from ident, and
    removed when the process exits."""
    tiers: list[KVTier] = []
    if settings.memory_gib > 0:
        from tandem.kv.store.host_tier import HostTier, default_shm_path

        path = settings.memory_path
        if path is None:
            path = default_shm_path(f"{ident}-{os.getpid()}")
            atexit.register(_remove, path)
        tiers.append(HostTier(path, int(settings.memory_gib * GiB), block_nbytes, settings.ttl_s))
    if settings.disk_dir is not None:
        from tandem.kv.store.disk_tier import DiskTier

        tiers.append(DiskTier(settings.disk_dir, int(settings.disk_gib * GiB), block_nbytes, settings.ttl_s))
    if settings.remote is not None:
        from tandem.kv.store.mooncake_tier import MooncakeTier

        tiers.append(MooncakeTier(settings.remote, block_nbytes, ttl_s=settings.ttl_s))
    return tiers


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclass
class StoreCounters:
    load_s: float = 0.0  # wall time of block loads, whatever tier served them
    loads: int = 0  # blocks loaded
    blocks_saved: int = 0
    blocks_skipped: int = 0  # already stored


class TieredStore:
    def __init__(self, tiers: list[KVTier], block_nbytes: int) -> None:
        if not tiers:
            raise ValueError("a KV store needs at least one tier")
        for t in tiers:
            if t.block_nbytes != block_nbytes:
                raise ValueError(f"tier {t.name} holds blocks of {t.block_nbytes} bytes, not {block_nbytes}")
        self.tiers = tiers
        self.block_nbytes = block_nbytes
        self.counters = StoreCounters()

    def contains(self, key: int) -> bool:
        return any(t.contains(key) for t in self.tiers)

    def num_leading(self, keys: Sequence[int]) -> int:
        """How many of keys, from the first, some tier holds (a chain stops at its first gap)."""
        for i, key in enumerate(keys):
            if not self.contains(key):
                return i
        return len(keys)

    def load(self, key: int, out: memoryview) -> str | None:
        """Load a block into out from the first tier that holds it and verifies; the tier's name,
        or None (a miss: recompute it)."""
        t0 = time.perf_counter()
        for i, tier in enumerate(self.tiers):
            if tier.load(key, out):
                for upper in self.tiers[:i]:
                    upper.save(key, out)
                self.counters.loads += 1
                self.counters.load_s += time.perf_counter() - t0
                return tier.name
        return None

    def save(self, key: int, payload: memoryview) -> None:
        if all(t.contains(key) for t in self.tiers):
            self.counters.blocks_skipped += 1
            return
        for tier in self.tiers:
            tier.save(key, payload)
        self.counters.blocks_saved += 1

    def flush(self) -> None:
        for t in self.tiers:
            t.flush()

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def stats(self) -> dict[str, TierStats]:
        return {t.name: t.stats() for t in self.tiers}
