"""The tiered KV store as a KV connector: blocks are saved as they fill and loaded instead of
recomputed.

Saving (write-through): after each step, every block that the step filled and no tier holds yet is
copied out of the pool in one gather (all layers of a block contiguous: one transfer per block) on
the engine thread; a saver thread digests and writes it into the tiers, so the step never waits for
a tier.

Loading: when a prompt's next blocks (past the pool's own prefix hits) are in the store, the
scheduler allocates blocks for them and the request waits in WAITING_FOR_KV while a loader thread
reads, verifies and copies them into the pool; the others' steps go on. A block that does not
verify ends the load there: the rest of the prompt is computed, and the answer is never wrong. An
aborted request keeps its blocks until the loader is done with them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tandem.engine.connectors.base import FinishedTransfers, KVConnector
from tandem.engine.request import Request
from tandem.engine.step import ConnectorMeta, ScheduledRequest
from tandem.kv.pool import KVPool
from tandem.kv.store.tiered import TieredStore

log = logging.getLogger(__name__)


def loadable_tokens(request: Request, num_computed_tokens: int, block_size: int,
                    num_leading: Callable[[list[int]], int]) -> int:
    """The prompt's tokens past those computed that the store can bring in: its next blocks that a tier
    holds, in a row, short of the block of the last prompt token (that one is computed: its logits
    sample). num_leading(keys): how many of keys, from the first, the store holds."""
    start = num_computed_tokens // block_size
    end = (request.num_tokens - 1) // block_size
    return num_leading(request.block_hashes[start:end]) * block_size


def unsaved_blocks(item: ScheduledRequest, saved: dict[str, int], block_size: int,
                   contains: Callable[[int], bool]) -> list[int]:
    """The indices of the blocks this step fills for the request that no tier holds yet (write-through:
    each block considered once; saved[request id] is the first block not considered, and moves on)."""
    request = item.request
    full = min((request.num_computed_tokens + item.num_new_tokens) // block_size, len(request.block_hashes))
    start = saved.get(request.request_id, 0)
    saved[request.request_id] = max(start, full)
    return [i for i in range(start, full) if not contains(request.block_hashes[i])]


@dataclass
class _Load:
    request_id: str
    keys: list[int]
    block_ids: list[int]
    block_size: int
    cancelled: bool = False


@dataclass
class _SavePlan(ConnectorMeta):
    """The blocks a step fills that no tier holds yet: copied out once the step is computed."""

    keys: list[int]
    block_ids: list[int]


@dataclass
class StoreCounters:
    loaded_tokens: int = 0
    load_requests: int = 0
    verify_failures_seen: int = 0  # loads cut short by a block that did not verify or vanished
    saved_blocks: int = 0
    dropped_saves: int = 0  # the saver fell behind: these blocks were not stored
    tier_hits: dict[str, int] = field(default_factory=dict)  # blocks loaded, by tier


class StoreConnector(KVConnector[_SavePlan]):
    def __init__(self, store: TieredStore, block_size: int, max_pending_saves: int = 256) -> None:
        self.store = store
        self.block_size = block_size
        self.counters = StoreCounters()
        self._kv: KVPool | None = None
        self._saved: dict[str, int] = {}  # request id -> blocks considered for saving
        self._plan: _SavePlan | None = None
        self._loads: dict[str, _Load] = {}
        self._loaded: dict[str, int] = {}  # finished, not yet taken: request id -> tokens
        self._released: set[str] = set()
        self._drops = 0
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._load_queue: queue.Queue[_Load | None] = queue.Queue()
        self._save_queue: queue.Queue[tuple[list[int], torch.Tensor] | None] = queue.Queue(max_pending_saves)
        self._threads = [threading.Thread(target=self._run_loads, name="kv-store-load", daemon=True),
                         threading.Thread(target=self._run_saves, name="kv-store-save", daemon=True)]
        for t in self._threads:
            t.start()

    # -- scheduler half -------------------------------------------------------------------------
    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return loadable_tokens(request, num_computed_tokens, self.block_size, self.store.num_leading)

    def on_allocated(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                     num_external_tokens: int) -> None:
        start = num_computed_tokens // self.block_size
        end = start + num_external_tokens // self.block_size
        load = _Load(request.request_id, request.block_hashes[start:end], block_ids[start:end], self.block_size)
        with self._lock:
            self._loads[request.request_id] = load
        self._load_queue.put(load)

    def take_finished(self) -> FinishedTransfers:
        with self._lock:
            loaded, self._loaded = self._loaded, {}
            released, self._released = self._released, set()
        return FinishedTransfers(loaded, released)

    def on_load_finished(self, request: Request, num_loaded_tokens: int) -> None:
        if request.num_preemptions == 0:
            request.num_cached_tokens += num_loaded_tokens  # to the user, a store hit is a cached token too
        self.counters.loaded_tokens += num_loaded_tokens

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._saved.pop(request.request_id, None)
        with self._lock:
            load = self._loads.get(request.request_id)
            if load is None:
                return False
            load.cancelled = True  # the loader may be writing its blocks: they are freed when it is done
            return True

    def build_step(self, items: list[ScheduledRequest]) -> _SavePlan | None:
        keys: list[int] = []
        block_ids: list[int] = []
        for item in items:
            for i in unsaved_blocks(item, self._saved, self.block_size, self.store.contains):
                keys.append(item.request.block_hashes[i])
                block_ids.append(item.block_ids[i])
        return _SavePlan(keys, block_ids) if keys else None

    def reset(self, request_id: str) -> None:
        self._saved.pop(request_id, None)

    def busy(self) -> bool:
        with self._lock:
            return bool(self._loads or self._loaded or self._released)

    def wait(self, timeout: float) -> None:
        with self._progress:
            if not (self._loaded or self._released):
                self._progress.wait(timeout)

    # -- worker half ----------------------------------------------------------------------------
    def register_kv_caches(self, pool: KVPool) -> None:
        self._kv = pool
        if pool.block_nbytes != self.store.block_nbytes:
            raise ValueError(f"the store holds blocks of {self.store.block_nbytes} bytes; this pool's are "
                             f"{pool.block_nbytes}")

    def start_step(self, meta: _SavePlan | None) -> None:
        self._plan = meta

    def finish_step(self) -> None:
        """Copy the blocks this step filled out of the pool (the step's compute is done) for the saver."""
        plan, self._plan = self._plan, None
        if plan is None or self._kv is None:
            return
        ids = torch.tensor(plan.block_ids, dtype=torch.long, device=self._kv.device)
        blocks = self._kv.read_blocks(ids)  # [n, layers, 2, ...], every KV head
        try:
            self._save_queue.put_nowait((plan.keys, blocks))
        except queue.Full:  # the store is a cache: these blocks are recomputed if they are needed again
            self.counters.dropped_saves += len(plan.keys)
            self._drops += 1
            if self._drops & (self._drops - 1) == 0:  # the 1st, 2nd, 4th... time
                log.warning("the KV store's saver is behind: %d blocks not saved so far", self.counters.dropped_saves)

    def _run_saves(self) -> None:
        while (job := self._save_queue.get()) is not None:
            keys, blocks = job
            raw = blocks.view(torch.uint8).numpy().reshape(len(keys), -1)
            for key, row in zip(keys, raw, strict=True):
                try:
                    self.store.save(key, memoryview(row))
                    self.counters.saved_blocks += 1
                except Exception:  # a store is a cache: a failed save is a later recompute
                    log.exception("saving a KV block failed")
            self._save_queue.task_done()
        self._save_queue.task_done()

    def flush(self) -> None:
        """Wait until every block handed to the saver is in the store (tests, shutdown)."""
        self._save_queue.join()
        self.store.flush()

    def _run_loads(self) -> None:
        staging = np.empty(self.store.block_nbytes, dtype=np.uint8)
        view = memoryview(staging)
        while (load := self._load_queue.get()) is not None:
            n = 0
            if not load.cancelled:
                n = self._load_blocks(load, staging, view)
            with self._progress:
                del self._loads[load.request_id]
                if load.cancelled:
                    self._released.add(load.request_id)
                else:
                    self._loaded[load.request_id] = n * load.block_size
                self._progress.notify_all()

    def _load_blocks(self, load: _Load, staging: np.ndarray, view: memoryview) -> int:
        assert self._kv is not None
        self.counters.load_requests += 1
        for n, (key, block_id) in enumerate(zip(load.keys, load.block_ids, strict=True)):
            if load.cancelled:
                return n
            tier = self.store.load(key, view)
            if tier is None:
                self.counters.verify_failures_seen += 1
                return n  # it vanished or did not verify: the rest is computed
            self.counters.tier_hits[tier] = self.counters.tier_hits.get(tier, 0) + 1
            self._kv.write_block(block_id, staging)
        return len(load.keys)

    def stats(self) -> dict[str, Any]:
        return {"tiers": self.store.stats(), "counters": self.counters, "load_s": self.store.counters.load_s}

    def close(self) -> None:
        self._load_queue.put(None)
        self._save_queue.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self.store.flush()
        self.store.close()
