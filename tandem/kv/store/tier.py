"""One tier of the KV store: whole blocks by key, each stored with a digest of what it holds.

A stored block is every layer's K and V for one block of tokens, contiguous (one transfer per
block, never one small fragment per layer). Its key is the block's prefix-cache hash (chained
through its parent, salted by the tenant and the model fingerprint), so the same key means the
same KV on every process and host. Every entry carries the key it was stored under and a digest of
its payload; a load that does not verify is dropped, counted, and reported as a miss, so a corrupt
file or a poisoned entry costs a recompute, never a wrong answer.
"""

from __future__ import annotations

import hashlib
import struct
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields

MAGIC = b"TKV1"
DIGEST_BYTES = 16
# magic, key (signed 64-bit), payload bytes, stored at (unix seconds), digest
HEADER = struct.Struct(f"<4sqqd{DIGEST_BYTES}s")


def digest(key: int, payload: memoryview | bytes) -> bytes:
    """sha256 (hardware-accelerated on x86 and ARM; hashlib drops the GIL for large buffers) over
    the key and the payload, truncated."""
    h = hashlib.sha256(key.to_bytes(8, "little", signed=True))
    h.update(payload)
    return h.digest()[:DIGEST_BYTES]


def pack_header(key: int, payload: memoryview | bytes, stored_at: float | None = None) -> bytes:
    return HEADER.pack(MAGIC, key, len(payload), time.time() if stored_at is None else stored_at,
                       digest(key, payload))


@dataclass
class EntryHeader:
    key: int
    nbytes: int
    stored_at: float
    digest: bytes

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> EntryHeader | None:
        """None for bytes that are not a header (never written, torn, another format)."""
        if len(raw) < HEADER.size:
            return None
        magic, key, nbytes, stored_at, dig = HEADER.unpack_from(raw)
        if magic != MAGIC:
            return None
        return cls(key, nbytes, stored_at, dig)

    def verifies(self, key: int, payload: memoryview | bytes) -> bool:
        return self.key == key and self.nbytes == len(payload) and digest(key, payload) == self.digest


@dataclass
class TierStats:
    hits: int = 0  # blocks loaded and verified
    misses: int = 0  # lookups or loads that found nothing usable
    loaded_bytes: int = 0
    saved_bytes: int = 0
    saves: int = 0
    evictions: int = 0
    verify_failures: int = 0  # entries that did not verify (dropped, recomputed)
    expired: int = 0  # entries past their time to live
    load_seconds: float = 0.0  # total time spent in load()
    used_blocks: int = 0
    capacity_blocks: int = 0


OCCUPANCY = ("used_blocks", "capacity_blocks")  # gauges: the rest of TierStats are running totals


def merge_tier_stats(parts: list[dict[str, TierStats]]) -> dict[str, TierStats]:
    """Several engines' views: counters add up; occupancy is the largest view (a host tier is one
    shared file that every worker on the host reports)."""
    out: dict[str, TierStats] = {}
    for part in parts:
        for tier, s in part.items():
            acc = out.setdefault(tier, TierStats())
            for f in fields(TierStats):
                a, b = getattr(acc, f.name), getattr(s, f.name)
                setattr(acc, f.name, max(a, b) if f.name in OCCUPANCY else a + b)
    return out


class KVTier(ABC):
    """A bounded store of fixed-size blocks with LRU eviction. Thread-safe: the engine saves from
    its step and loads from a loader thread."""

    name: str
    block_nbytes: int

    @abstractmethod
    def contains(self, key: int) -> bool:
        """Whether a load of key would probably succeed (it may still fail verification)."""

    @abstractmethod
    def load(self, key: int, out: memoryview) -> bool:
        """Copy the block into out (block_nbytes, writable) if it is here and verifies. A block being
        read is pinned: no concurrent save evicts or overwrites it until the copy is done. An entry
        that does not verify, or has outlived the time to live, is removed and counted."""

    @abstractmethod
    def save(self, key: int, payload: memoryview) -> None:
        """Store a block (block_nbytes) under key, evicting the least recently used entries for room.
        May return before the data is durable (the disk tier writes on a thread); a key already here
        is only touched. Never raises for a full or failing tier: the store is a cache."""

    def flush(self) -> None:
        """Wait until every save so far is visible to load() (tests, shutdown)."""
        return None

    def close(self) -> None:
        """Release what the tier holds in this process (the data itself may outlive it)."""
        return None

    @abstractmethod
    def stats(self) -> TierStats: ...
