"""Retained conversations in the KV cache manager (a stored response's KV, kept for its next turn):
their blocks outlive other requests' pressure, are counted as held, give way (oldest first) to an
allocation that needs them so that nothing stalls, stay within their bound, and come back on release."""

from __future__ import annotations

from tandem.engine.request import Request
from tandem.kv.manager import KVCacheManager
from tandem.sampling_params import SamplingParams

BS = 4


def finished(kv: KVCacheManager, rid: str, tokens: list[int], retain: str | None = None) -> Request:
    """A request whose tokens were all computed, then finished (retained under `retain` first)."""
    request = Request(rid, tokens, SamplingParams(max_tokens=1))
    cached, num_cached = kv.get_computed_blocks(request)  # as the scheduler admits it: prefix hits first
    request.num_computed_tokens = 0
    assert kv.allocate_slots(request, len(tokens) - num_cached, cached) is not None
    request.num_computed_tokens = len(tokens)
    kv.cache_blocks(request, len(tokens))
    if retain is not None:
        kv.retain(retain, request)
    kv.free(request)
    return request


def hits(kv: KVCacheManager, tokens: list[int]) -> int:
    probe = Request("probe", tokens, SamplingParams(max_tokens=1))
    return kv.get_computed_blocks(probe)[1]


def held(kv: KVCacheManager) -> int:
    return kv.pool.num_blocks - kv.pool.num_free_blocks


def test_a_retained_conversation_outlives_pressure_and_comes_back_on_release() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    history = list(range(100, 113))  # 13 tokens: 3 full blocks cached
    finished(kv, "turn1", history, retain="resp_1")
    assert held(kv) == 3 and kv.retained["resp_1"]
    # Another tenant's traffic takes every other block, twice over: the history stays cached.
    for i in range(2):
        other = Request(f"other{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 52)), SamplingParams(max_tokens=1))
        assert kv.allocate_slots(other, 52) is not None  # 13 blocks: all but the retained 3
        kv.free(other)
    assert hits(kv, [*history, 7, 8]) == 12
    assert kv.release("resp_1") and not kv.release("resp_1") and held(kv) == 0
    assert hits(kv, [*history, 7, 8]) == 12  # released blocks stay cached until evicted


def test_retention_gives_way_to_an_allocation_that_needs_its_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    finished(kv, "a", list(range(100, 113)), retain="resp_a")  # 3 blocks, oldest
    finished(kv, "b", list(range(200, 213)), retain="resp_b")  # 3 blocks
    big = Request("big", list(range(5000, 5000 + 48)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(big, 48) is not None  # 12 blocks: only 10 are free, so resp_a gives way
    assert list(kv.retained) == ["resp_b"] and held(kv) == 15
    huge = Request("huge", list(range(9000, 9000 + 16)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(huge, 16) is not None  # 4 more: resp_b gives way too; nothing is refused
    assert not kv.retained
    kv.free(big)
    kv.free(huge)
    assert held(kv) == 0


def test_retained_blocks_stay_within_their_bound_and_a_handle_holds_its_latest_turn() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    assert kv.max_retained_blocks == 8
    finished(kv, "a", list(range(100, 113)), retain="resp_a")  # 3
    finished(kv, "b", list(range(200, 221)), retain="resp_b")  # 5: 8 held, at the bound
    assert list(kv.retained) == ["resp_a", "resp_b"] and held(kv) == 8
    finished(kv, "c", list(range(300, 305)), retain="resp_c")  # 1 more: the oldest goes
    assert list(kv.retained) == ["resp_b", "resp_c"] and held(kv) == 6
    finished(kv, "c2", list(range(300, 313)), retain="resp_c")  # the same handle again: its blocks replaced
    assert list(kv.retained) == ["resp_b", "resp_c"] and held(kv) == 5 + 3
    finished(kv, "d", list(range(400, 445)), retain="resp_d")  # 11 blocks, past the bound: its first 8
    assert list(kv.retained) == ["resp_d"] and held(kv) == 8
    finished(kv, "pressure", list(range(900, 932)))  # the 8 other blocks: d's tail is evicted
    assert hits(kv, list(range(400, 445))) == 8 * BS  # its retained first blocks remain a prefix hit
    for handle in ("resp_b", "resp_c", "resp_d"):
        kv.release(handle)
    assert held(kv) == 0 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
