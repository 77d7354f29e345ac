"""The KV block pool: ref-counted blocks, an O(1) LRU free queue, and the hash -> block map.

A freed block keeps its hash (lazy eviction): it stays findable by prefix-cache lookups until
the free queue hands it out again. The free queue is a doubly linked list in eviction order, so
allocation, freeing and pulling a cache hit out of the queue are all O(1).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_hash: int | None
    salt: str | None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]


BlockEvent = BlockStored | BlockRemoved


class FreeBlockQueue:
    """Doubly linked list of free blocks; the head is evicted first."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise RuntimeError("no free KV blocks")
        self.remove(first)
        return first

    def __iter__(self):  # for invariant checks in tests
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, record_events: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.record_events = record_events
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.events: list[BlockEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def uncache(self, block: KVBlock) -> None:
        """Forget a block's hash while it is in use (its KV turned out not to be written)."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            if self.record_events:
                self.events.append(BlockRemoved([block.block_hash]))
        block.block_hash = None

    def lookup(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits; a hit sitting in the free queue leaves it."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue in the order given."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: int, parent_hash: int | None, salt: str | None) -> None:
        if block.block_hash is not None:
            return  # already cached (a hit, or cached in an earlier step)
        block.block_hash = block_hash
        # On a duplicate (two requests computed the same block concurrently) the first stays the
        # canonical copy; the second is freed normally and never found by lookups.
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            if self.record_events:
                self.events.append(BlockStored([block_hash], parent_hash, salt))

    def take_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True
