"""The KV cache manager: the only door into the block pool.

The scheduler asks it for slots and frees through it; it keeps each request's block table and
the prefix-cache bookkeeping (hashing, hits, caching blocks as they fill).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from tandem.kv.block_pool import BlockPool, KVBlock
from tandem.kv.hashing import HASH_FUNCTIONS, extend_block_hashes, salt_key

# At most this share of the pool is kept for retained conversations (which give way to any allocation
# that needs their blocks anyway): the rest stays the prefix cache's and the running requests'.
RETAINED_FRACTION = 0.5


class KVRequest(Protocol):
    """What the cache needs of a request (the engine's Request): storage imports nothing of the engine."""

    request_id: str
    all_token_ids: Sequence[int]
    block_hashes: list[int]
    cache_salt: str | None
    num_computed_tokens: int
    num_preemptions: int

    @property
    def num_tokens(self) -> int: ...


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class KVCacheUsage:
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 hash_algo: str = "sha256", record_events: bool = False, key_extra: tuple = ()) -> None:
        self.block_size = block_size
        # Part of every block's key: the model fingerprint, so a key means the same KV everywhere.
        self.key_extra = key_extra
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.hash_fn = HASH_FUNCTIONS[hash_algo]
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # The same blocks' ids, appended as blocks are added: a step reads them without rebuilding.
        self.req_block_ids: dict[str, list[int]] = {}
        # Requests whose blocks were freed since take_freed(): the runner drops their block-table rows.
        self._freed: list[str] = []
        # How many of a request's blocks are already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()
        # Retained conversations (the Responses API's stored responses): a handle -> the cached blocks it
        # keeps from eviction, oldest first. Bounded; given back, oldest first, when an allocation would
        # otherwise fail, so that retention never stalls running requests.
        self.retained: OrderedDict[str, list[KVBlock]] = OrderedDict()
        self.max_retained_blocks = int(num_blocks * RETAINED_FRACTION)
        self._num_retained = 0

    # -- prefix cache -------------------------------------------------------------------------
    def update_block_hashes(self, request: KVRequest) -> None:
        if self.enable_caching:
            extend_block_hashes(request.block_hashes, request.all_token_ids, self.block_size, self.hash_fn,
                                self.key_extra + salt_key(request.cache_salt))

    def get_computed_blocks(self, request: KVRequest) -> tuple[list[KVBlock], int]:
        """The longest cached run of the request's full blocks, and the tokens it covers.

        The last token is always left to compute, since its logits are needed to sample.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, request: KVRequest, num_hit_tokens: int) -> None:
        """Count a prompt's lookup once, when it is admitted (a request stuck at the head of the
        queue is looked up every step), and not again after a preemption, as vLLM does."""
        if self.enable_caching and request.num_preemptions == 0:
            self.prefix_stats.queries += request.num_tokens
            self.prefix_stats.hits += num_hit_tokens

    # -- retained conversations ---------------------------------------------------------------
    def retain(self, handle: str, request: KVRequest) -> None:
        """Keep the request's cached full blocks (its prompt and reply) in the prefix cache under
        `handle` until release(handle): another tenant's traffic cannot evict them. Past the bound the
        oldest handle is released; a conversation longer than the bound keeps its first blocks (a
        follow-up still finds that prefix cached)."""
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = [b for b in self.req_blocks.get(rid, [])[:self._num_cached_blocks.get(rid, 0)]
                  if b.block_hash is not None and self.pool.lookup(b.block_hash) is b]
        # A prefix's blocks are the cache's only use to a follow-up: stop at the first one not cached.
        blocks = blocks[:self.max_retained_blocks]
        self.release(handle)
        if not blocks:
            return
        self.pool.touch(blocks)
        self.retained[handle] = blocks
        self._num_retained += len(blocks)
        while self._num_retained > self.max_retained_blocks:
            self.release(next(iter(self.retained)))

    def release(self, handle: str) -> bool:
        """Give a retained conversation's blocks back (they stay cached until evicted)."""
        blocks = self.retained.pop(handle, None)
        if blocks is None:
            return False
        self._num_retained -= len(blocks)
        self.pool.free(reversed(blocks))
        return True

    # -- allocation ---------------------------------------------------------------------------
    def could_hold(self, request: KVRequest, hits: list[KVBlock]) -> bool:
        """Whether the pool could hold all of a waiting request's tokens (its prompt, and a resumed
        one's output) beside what it holds now: free blocks and retained conversations (which give
        way to an allocation) count, and so do the request's hits."""
        need = cdiv(request.num_tokens, self.block_size) - len(hits) + sum(1 for b in hits if b.ref_cnt == 0)
        return need <= self.pool.num_free_blocks + self._num_retained

    def allocate_slots(self, request: KVRequest, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0, defer_caching: bool = False) -> list[KVBlock] | None:
        """Make room for num_new_tokens (plus lookahead) after the computed ones; None if the pool
        cannot, in which case nothing changes. With defer_caching the new blocks stay private until
        cache_blocks() (their KV is written by someone else, later: a disaggregated prefill)."""
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks:  # a running request: the common case, kept short
            num_computed = request.num_computed_tokens
            end = num_computed + num_new_tokens
            if cdiv(end + num_lookahead_tokens, self.block_size) <= len(blocks):  # no new block needed
                if self.enable_caching and not defer_caching and \
                        end // self.block_size > self._num_cached_blocks.get(request.request_id, 0):
                    self._cache_full_blocks(request, blocks, end)
                return []
        new_computed_blocks = new_computed_blocks or []
        if blocks is None:
            blocks = self.req_blocks[request.request_id] = []
            self.req_block_ids[request.request_id] = []
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(num_required - len(blocks) - len(new_computed_blocks), 0)
        # Hits with no other user sit in the free queue: taking them also consumes free blocks.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        while self.retained and num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            # Retention gives way: the oldest retained conversation first (its blocks stay cached, and
            # any of them among this request's hits now sit in the free queue too).
            self.release(next(iter(self.retained)))
            num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_blocks[request.request_id], self.req_block_ids[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        ids = self.req_block_ids[request.request_id]
        for added in (new_computed_blocks, new_blocks):
            blocks.extend(added)
            ids.extend(b.block_id for b in added)
        if self.enable_caching and not defer_caching:
            # Blocks that will be full once this step's tokens are computed become shareable now:
            # a request scheduled later in the same step reads them after this step writes them.
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        """Make the request's full blocks up to num_tokens shareable (their KV is now in place)."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_blocks.get(request.request_id, []), num_tokens)

    def _cache_full_blocks(self, request: KVRequest, blocks: list[KVBlock], num_tokens: int) -> None:
        self.update_block_hashes(request)
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            parent = request.block_hashes[i - 1] if i else None
            self.pool.cache_block(blocks[i], request.block_hashes[i], parent, request.cache_salt)
        self._num_cached_blocks[request.request_id] = max(start, end)

    def uncache_uncomputed(self, request: KVRequest) -> list[int]:
        """Withdraw the request's blocks past its computed tokens from the prefix cache (a step that
        was to fill them failed) and return their ids, so that nobody reads KV that was never written."""
        blocks = self.req_blocks.get(request.request_id, [])
        first = request.num_computed_tokens // self.block_size
        for block in blocks[first:]:
            self.pool.uncache(block)
        self._num_cached_blocks[request.request_id] = min(self._num_cached_blocks.get(request.request_id, 0), first)
        return [b.block_id for b in blocks[first:]]

    def free(self, request: KVRequest) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        if self.req_block_ids.pop(request.request_id, None) is not None:
            self._freed.append(request.request_id)
        # Tail blocks are the least likely to be shared, so they are evicted first.
        self.pool.free(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, for whoever keeps them (a connector)."""
        return list(self.req_block_ids.get(request_id, ()))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block ids, live: appended to as blocks are added, replaced by a new list when
        the request is freed and allocated again. For reading within one step; never modify it."""
        return self.req_block_ids.get(request_id, [])

    def take_freed(self) -> list[str]:
        """The requests whose blocks were freed since the last call."""
        freed, self._freed = self._freed, []
        return freed

    def usage(self) -> KVCacheUsage:
        free = self.pool.num_free_blocks
        # Cached-but-free blocks count as free: they are reclaimable at any moment.
        return KVCacheUsage(self.pool.num_blocks, self.pool.num_blocks - free, free)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
