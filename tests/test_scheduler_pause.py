"""A paused request (a live migration's source side) holds its blocks and gets no steps; it decodes
on when resumed, frees everything when aborted, and only a decoding request can be paused."""

from __future__ import annotations

from test_kv_scheduler_stress import check_invariants

from tandem.config import CacheConfig, SchedulerConfig
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler
from tandem.sampling_params import SamplingParams


def step(scheduler: Scheduler) -> set[str]:
    """One step, every row that reaches its end sampling token 7; the ids scheduled."""
    out = scheduler.schedule()
    check_invariants(scheduler)
    sampled = {s.request.request_id: [7] for s in out.scheduled
               if s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens}
    scheduler.update_from_output(out, sampled)
    check_invariants(scheduler)
    return {s.request.request_id for s in out.scheduled}


def test_pause_holds_blocks_and_steps_until_resumed() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=8),
                          CacheConfig(block_size=4, enable_prefix_caching=True), 64, 256)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    scheduler.add_request(Request("a", list(range(10)), params))
    scheduler.add_request(Request("b", list(range(100, 130)), params))
    assert scheduler.pause("a") is None  # waiting: nothing computed to move
    step(scheduler)
    assert scheduler.pause("b") is None  # still in its prompt (30 tokens at 16 a step)
    while scheduler.requests["b"].num_output_tokens == 0:
        step(scheduler)
    a = scheduler.requests["a"]
    blocks = scheduler.kv.get_block_ids("a")
    outputs = list(a.output_token_ids)
    assert scheduler.pause("a") is a
    assert a.num_tokens - a.num_computed_tokens == 1  # KV complete up to the newest token
    assert scheduler.pause("a") is None  # already paused
    for _ in range(3):
        assert step(scheduler) == {"b"}
    assert scheduler.kv.get_block_ids("a") == blocks and a.output_token_ids == outputs
    assert scheduler.resume("a") and not scheduler.resume("a")
    assert "a" in step(scheduler) and a.num_output_tokens == len(outputs) + 1
    scheduler.pause("a")
    scheduler.abort("a")
    scheduler.abort("b")
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks and not scheduler.paused
    assert not scheduler.has_unfinished()


def test_a_paused_request_alone_needs_no_steps() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8),
                          CacheConfig(block_size=4), 16, 64)
    scheduler.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)))
    step(scheduler)
    assert scheduler.pause("a") is not None
    assert not scheduler.has_unfinished()  # the engine idles: the migration is the worker's work
    scheduler.resume("a")
    assert scheduler.has_unfinished()
    while scheduler.has_unfinished():
        step(scheduler)
    assert scheduler.kv.pool.num_free_blocks == scheduler.kv.pool.num_blocks
