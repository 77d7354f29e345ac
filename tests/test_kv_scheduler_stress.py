"""Property-based stress of the scheduler and the KV cache manager, without a model.

Arrivals, prompt lengths, output lengths and aborts are drawn by hypothesis; each step the
'model' returns a token for every request that reached its end. After every step the pool's
invariants must hold, and after the run every block is free.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.config import CacheConfig, SchedulerConfig
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.kv.block_pool import BlockPool
from tandem.sampling_params import SamplingParams


def check_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    pool: BlockPool = kv.pool
    users = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == users[block.block_id], f"block {block.block_id}: ref {block.ref_cnt}"
    free = list(pool.free_queue)
    assert len(free) == pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    assert len({b.block_id for b in free}) == len(free)
    assert all(b.ref_cnt == 0 for b in free)
    # Without prefix caching no block is shared; with it, only blocks with a hash can be.
    for block_id, n in users.items():
        assert n == 1 or pool.blocks[block_id].block_hash is not None
    for blocks in kv.req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a block twice in one table"
    for h, block in pool.cached.items():
        assert block.block_hash == h
    for r in scheduler.running:
        assert len(kv.req_blocks[r.request_id]) * kv.block_size >= r.num_computed_tokens


requests_strategy = st.lists(
    st.tuples(st.integers(0, 6),  # arrival step
              st.integers(1, 120),  # prompt length
              st.integers(1, 40),  # max_tokens
              st.integers(0, 3),  # which of a few shared prefixes (prefix-cache sharing)
              st.one_of(st.none(), st.integers(1, 30))),  # abort at this step, or never
    min_size=1, max_size=24)


@settings(max_examples=120, deadline=None)
@given(reqs=requests_strategy, num_blocks=st.integers(10, 60), budget=st.sampled_from([8, 32, 256]),
       max_seqs=st.sampled_from([2, 8, 64]), caching=st.booleans(), salts=st.booleans())
def test_scheduler_keeps_pool_invariants(reqs, num_blocks, budget, max_seqs, caching, salts) -> None:  # noqa: ANN001
    block_size = 4
    max_len = num_blocks * block_size
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs),
                          CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                          num_blocks, max_len)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    aborts: dict[int, list[str]] = {}
    step, finished = 0, 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][1][0] <= step:
            i, (_, plen, max_tokens, prefix, abort_at) = pending.pop(0)
            plen = min(plen, max_len - max_tokens) if max_len > max_tokens else 1
            prompt = [(prefix * 1000 + t) % 500 for t in range(plen)]
            params = SamplingParams(max_tokens=min(max_tokens, max_len - plen), ignore_eos=True)
            scheduler.add_request(Request(str(i), prompt, params, cache_salt=str(i % 2) if salts else None))
            if abort_at is not None:
                aborts.setdefault(step + abort_at, []).append(str(i))
        for rid in aborts.pop(step, []):
            scheduler.abort(rid)
        out = scheduler.schedule()
        check_invariants(scheduler)
        assert out.total_num_tokens <= budget
        assert len(out.scheduled) <= max_seqs
        sampled = {s.request.request_id: [step % 500] for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens}
        for request, _ in scheduler.update_from_output(out, sampled):
            finished += request.is_finished
        check_invariants(scheduler)
        step += 1
        assert step < 5000, "no progress: the scheduler deadlocked"
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert not scheduler.kv.req_blocks


def test_salts_never_share_blocks() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 64, 256)
    prompt = list(range(40))
    for rid, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        scheduler.add_request(Request(rid, prompt, SamplingParams(max_tokens=4), cache_salt=salt))
        out = scheduler.schedule()
        scheduler.update_from_output(out, {s.request.request_id: [1] for s in out.scheduled})
    tables = {rid: set(scheduler.kv.get_block_ids(rid)) for rid in "abc"}
    assert not tables["a"] & tables["b"]
    assert len(tables["a"] & tables["c"]) == 9  # 39 of 40 prompt tokens may hit: 9 full blocks
    for rid in "abc":
        scheduler.abort(rid)
    assert scheduler.kv.pool.num_free_blocks == 64


def test_prefix_hit_accounting_exact() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=16), 64, 1024)
    shared = list(range(100, 164))  # 4 full blocks
    scheduler.add_request(Request("first", shared + [1, 2, 3], SamplingParams(max_tokens=1)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"first": [7]})  # finishes (max_tokens=1); blocks stay cached
    scheduler.add_request(Request("second", shared + [9] * 20, SamplingParams(max_tokens=1)))
    out = scheduler.schedule()
    second = out.scheduled[0]
    assert second.request.num_cached_tokens == 64
    assert second.num_new_tokens == 20
    stats = scheduler.kv.prefix_stats
    assert (stats.queries, stats.hits) == (67 + 84, 64)
    scheduler.update_from_output(out, {"second": [7]})
    assert scheduler.kv.pool.num_free_blocks == 64


def test_preemption_under_pressure_never_deadlocks() -> None:
    # Two requests that each need most of the pool: one must be preempted and recomputed.
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=4,
                          enable_prefix_caching=False), 12, 48)
    for rid in "ab":
        scheduler.add_request(Request(rid, list(range(20)), SamplingParams(max_tokens=20, ignore_eos=True)))
    done = set()
    for _ in range(500):
        out = scheduler.schedule()
        sampled = {s.request.request_id: [5] for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens}
        for r, _ in scheduler.update_from_output(out, sampled):
            if r.is_finished:
                done.add(r.request_id)
                assert r.num_output_tokens == 20
        if not scheduler.has_unfinished():
            break
    assert done == {"a", "b"}
    assert scheduler.num_preemptions > 0


def test_a_prompt_that_does_not_fit_beside_the_running_ones_waits_instead_of_being_computed_twice() -> None:
    """A long prompt arriving while a short request decodes: started in chunks, it would run the pool
    dry part-way and be preempted (its computed chunks thrown away, 18 times on one test's batch).
    It waits until the pool can hold all of it, then computes each token once."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(block_size=16,
                          enable_prefix_caching=False), 40, 1024)
    scheduler.add_request(Request("short", list(range(100)), SamplingParams(max_tokens=60, ignore_eos=True)))
    scheduler.add_request(Request("long", list(range(1, 601)), SamplingParams(max_tokens=4, ignore_eos=True)))
    computed: Counter = Counter()
    waited = 0
    for _ in range(500):
        out = scheduler.schedule()
        for s in out.scheduled:
            computed[s.request.request_id] += s.num_new_tokens
        waited += "long" in scheduler.requests and not any(s.request.request_id == "long" for s in out.scheduled)
        sampled = {s.request.request_id: [5] for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens}
        scheduler.update_from_output(out, sampled)
        check_invariants(scheduler)
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished() and scheduler.num_preemptions == 0
    assert waited > 0  # it did wait for the short request
    # Each token computed once: the prompt, then one a step for every output but the last.
    assert computed == {"short": 100 + 59, "long": 600 + 3}
    assert scheduler.kv.pool.num_free_blocks == 40


def test_block_events_stored_and_removed() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=4, enable_kv_events=True), 6, 24)
    scheduler.add_request(Request("a", list(range(9)), SamplingParams(max_tokens=1)))
    out = scheduler.schedule()
    scheduler.update_from_output(out, {"a": [1]})
    events = scheduler.kv.pool.take_events()
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockStored"]
    assert events[1].parent_hash == events[0].block_hashes[0]
    # A new request that needs every block evicts the cached ones.
    scheduler.add_request(Request("b", list(range(100, 121)), SamplingParams(max_tokens=1)))
    scheduler.update_from_output(scheduler.schedule(), {"b": [1]})
    removed = [e for e in scheduler.kv.pool.take_events() if type(e).__name__ == "BlockRemoved"]
    assert {h for e in removed for h in e.block_hashes} == {h for e in events for h in e.block_hashes}


def test_prefix_lookups_counted_once_while_blocked() -> None:
    # The pool fits one request at a time: the second waits at the head of the queue for several
    # steps, and its lookup must still be counted once.
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(block_size=4), 8, 32)
    for rid, start in (("a", 0), ("b", 100)):
        scheduler.add_request(Request(rid, list(range(start, start + 20)),
                                      SamplingParams(max_tokens=8, ignore_eos=True)))
    for _ in range(40):
        out = scheduler.schedule()
        sampled = {s.request.request_id: [1] for s in out.scheduled
                   if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens}
        scheduler.update_from_output(out, sampled)
        if not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()
    assert scheduler.kv.prefix_stats.queries == 40
    assert scheduler.kv.prefix_stats.hits == 0


def test_long_prefill_token_threshold_lets_short_prompts_share_the_step() -> None:
    config = SchedulerConfig(max_num_batched_tokens=96, long_prefill_token_threshold=32)
    scheduler = Scheduler(config, CacheConfig(block_size=4), num_blocks=128, max_model_len=512)
    params = SamplingParams(max_tokens=2)
    long, short = Request("long", list(range(1, 201)), params), Request("short", list(range(300, 320)), params)
    scheduler.add_request(long)
    scheduler.add_request(short)
    out = scheduler.schedule()
    # Without the cap the long prompt would take the whole budget and the short one would wait.
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"long": 32, "short": 20}
    scheduler.update_from_output(out, {"short": [7]})
    out = scheduler.schedule()
    assert {s.request.request_id: s.num_new_tokens for s in out.scheduled} == {"long": 32, "short": 1}
    for rid in ("long", "short"):
        scheduler.abort(rid)
    check_invariants(scheduler)
    assert scheduler.kv.pool.num_free_blocks == 128
