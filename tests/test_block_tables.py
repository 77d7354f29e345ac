"""The runner's persistent block tables (engine/block_table.py) against tables built afresh each step,
over random steps of growing, freed and re-allocated requests; and the KV manager's live id lists."""

from __future__ import annotations

import random

import numpy as np

from tandem.engine.block_table import BlockTables
from tandem.engine.request import Request
from tandem.engine.step import ScheduledRequest
from tandem.kv.manager import KVCacheManager
from tandem.sampling_params import SamplingParams


def fresh(items: list[ScheduledRequest]) -> np.ndarray:
    width = max((len(s.block_ids) for s in items), default=0)
    table = np.zeros((len(items), width), dtype=np.int32)
    for row, s in enumerate(items):
        table[row, :len(s.block_ids)] = s.block_ids
    return table


def test_gathered_tables_equal_tables_built_afresh() -> None:
    rng = random.Random(0)
    tables = BlockTables(rows=2, blocks=2)  # tiny, so rows and columns grow
    live: dict[str, list[int]] = {}
    params = SamplingParams(max_tokens=1)
    requests = {f"r{i}": Request(f"r{i}", [1], params) for i in range(12)}
    next_block = 0
    for _ in range(400):
        rid = rng.choice(list(requests))
        action = rng.random()
        if rid in live and action < 0.15:  # freed (finished or preempted): its row goes
            del live[rid]
            tables.release([rid])
        elif rid in live and action < 0.25:  # freed and allocated again without the runner being told
            live[rid] = [next_block]
            next_block += 1
        else:  # grows by a few blocks, or not at all
            ids = live.setdefault(rid, [])
            for _ in range(rng.choice([0, 0, 1, 3, 9])):
                ids.append(next_block)
                next_block += 1
        items = [ScheduledRequest(requests[r], 1, ids) for r, ids in live.items() if rng.random() < 0.7]
        if items:
            np.testing.assert_array_equal(tables.gather(items), fresh(items))


def test_the_managers_live_ids_follow_its_blocks_and_report_frees() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=True)
    request = Request("a", list(range(6)), SamplingParams(max_tokens=8))
    kv.allocate_slots(request, 6)
    live = kv.block_ids("a")
    assert live == [b.block_id for b in kv.req_blocks["a"]] and len(live) == 2
    copy = kv.get_block_ids("a")
    request.num_computed_tokens = 6
    kv.allocate_slots(request, 3)  # 9 tokens: a third block
    assert live == [b.block_id for b in kv.req_blocks["a"]] and len(live) == 3
    assert len(copy) == 2  # a copy does not move
    assert kv.take_freed() == []
    kv.free(request)
    assert kv.take_freed() == ["a"] and kv.take_freed() == []
    assert kv.block_ids("a") == [] and kv.pool.num_free_blocks == 16
