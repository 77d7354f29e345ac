"""The router's index of which worker holds which KV blocks, by block key.

Fed by each worker's KV events (`BlockStored` / `BlockRemoved`, the keys every process computes
alike, kv/hashing.py). Events can be missing (a worker that does not send them) or late (a request
routed a moment ago has not filled its blocks yet), so the router also records its own decisions:
the blocks of a prompt it just sent to a worker count as held there until they expire, unless an
event said otherwise since (Dynamo's approximate mode). A worker that dies or restarts is forgotten
at once: its pool came back empty.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

from tandem.kv.block_pool import BlockEvent, BlockRemoved, BlockStored

PRUNE_MIN = 4096  # predicted keys a worker may have before expired ones are swept


class PrefixIndex:
    def __init__(self, predict_ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.predict_ttl_s = predict_ttl_s
        self.clock = clock
        self._held: dict[str, set[int]] = {}  # worker id -> keys its events say it caches
        self._predicted: dict[str, dict[int, float]] = {}  # worker id -> key -> expiry
        self._prune_at: dict[str, int] = {}  # worker id -> size at which its expired keys are dropped

    def apply(self, worker_id: str, events: Iterable[BlockEvent]) -> None:
        held = self._held.setdefault(worker_id, set())
        predicted = self._predicted.get(worker_id, {})
        for event in events:
            if isinstance(event, BlockStored):
                held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held.difference_update(event.block_hashes)
                for key in event.block_hashes:  # the worker's word beats the router's guess
                    predicted.pop(key, None)

    def predict(self, worker_id: str, keys: Sequence[int]) -> None:
        """The router just sent a prompt with these block keys to the worker."""
        if self.predict_ttl_s <= 0:
            return
        now = self.clock()
        expiry = now + self.predict_ttl_s
        predicted = self._predicted.setdefault(worker_id, {})
        for key in keys:
            predicted[key] = expiry
        if len(predicted) > self._prune_at.get(worker_id, PRUNE_MIN):
            # Keys nobody looks up again would stay forever: drop the expired ones whenever the map has
            # doubled since the last time (amortized O(1) a key).
            for key in [k for k, e in predicted.items() if e < now]:
                del predicted[key]
            self._prune_at[worker_id] = max(PRUNE_MIN, 2 * len(predicted))

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)
        self._predicted.pop(worker_id, None)
        self._prune_at.pop(worker_id, None)

    def overlap(self, worker_id: str, keys: Sequence[int]) -> int:
        """How many of keys, from the first, the worker holds (or was just sent)."""
        held = self._held.get(worker_id, set())
        predicted = self._predicted.get(worker_id, {})
        now = self.clock()
        n = 0
        for key in keys:
            if key in held:
                n += 1
                continue
            expiry = predicted.get(key)
            if expiry is None:
                break
            if expiry < now:
                del predicted[key]
                break
            n += 1
        return n

    def num_keys(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ())) + len(self._predicted.get(worker_id, ()))
