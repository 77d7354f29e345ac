"""Routing policies over a scripted prefix index: overlap beats load within the guard, the guard
spreads one hot prefix, the router's own predictions expire, a forgotten worker attracts nothing."""

from __future__ import annotations

from fake_clock import Clock

from tandem.disagg.router.registry import WorkerHandle
from tandem.disagg.worker.messages import WorkerInfo
from tandem.engine.core_report import CoreInfo
from tandem.kv.block_pool import BlockRemoved, BlockStored
from tandem.policy.prefix_index import PrefixIndex
from tandem.policy.routing import Router, RoutingSettings


def worker(wid: str, load: int = 0) -> WorkerHandle:
    w = WorkerHandle(WorkerInfo(wid, "colocated", CoreInfo(2048, 100, None, 64, "m"), None, "h", 1, None), wid.encode())
    w.inflight = {f"{wid}-{i}" for i in range(load)}
    return w


def router(index: PrefixIndex, policy: str = "kv", **settings: float) -> Router:
    # Decode load: 4 blocks per request in flight.
    return Router(RoutingSettings(policy, **settings), index, lambda w: 4 * len(w.inflight))


PROMPT = list(range(100, 164))  # 64 block keys


def test_overlap_beats_load_within_the_guard() -> None:
    index = PrefixIndex()
    index.apply("a", [BlockStored(PROMPT[:48], None, None)])
    a, b = worker("a", load=2), worker("b", load=1)
    pick = router(index).pick(PROMPT, 65, [a, b])
    assert pick is not None and pick.worker is a and pick.overlap_blocks == 48 and not pick.guarded
    # Without the overlap the lighter worker wins.
    index.apply("a", [BlockRemoved(PROMPT[:48])])
    assert router(index).pick(PROMPT, 65, [a, b]).worker is b


def test_the_guard_spreads_one_hot_prefix() -> None:
    index = PrefixIndex()
    a, b = worker("a"), worker("b")
    r = router(index, guard_ratio=1.5)
    placed = {"a": 0, "b": 0}
    for i in range(20):  # every request shares the whole prompt: a system prompt everyone uses
        pick = r.pick(PROMPT, 65, [a, b])
        r.routed(pick.worker, PROMPT)
        pick.worker.inflight.add(f"r{i}")
        placed[pick.worker.worker_id] += 1
    mean = sum(placed.values()) / 2
    assert max(placed.values()) <= 1.5 * mean + 1
    assert min(placed.values()) > 0


def test_predictions_expire_and_events_override_them() -> None:
    clock = Clock()
    index = PrefixIndex(predict_ttl_s=10, clock=clock)
    index.predict("a", PROMPT[:8])
    assert index.overlap("a", PROMPT) == 8
    clock.now = 5
    index.apply("a", [BlockRemoved(PROMPT[4:5])])  # the worker says block 4 is gone
    assert index.overlap("a", PROMPT) == 4
    clock.now = 11
    assert index.overlap("a", PROMPT) == 0
    index.apply("a", [BlockStored(PROMPT[:2], None, None)])  # events do not expire
    clock.now = 1000
    assert index.overlap("a", PROMPT) == 2


def test_expired_predictions_nobody_looks_up_are_swept() -> None:
    """A server sees a stream of unique prompts: their predicted keys must not pile up forever."""
    clock = Clock()
    index = PrefixIndex(predict_ttl_s=10, clock=clock)
    for i in range(200):
        clock.now = i  # a prompt of 100 fresh blocks a second; each lives 10 s
        index.predict("a", range(i * 100, i * 100 + 100))
    assert index.num_keys("a") <= 2 * 4096 + 100, index.num_keys("a")
    assert index.overlap("a", range(199 * 100, 199 * 100 + 100)) == 100, "the live ones stay"


def test_a_forgotten_worker_attracts_nothing() -> None:
    index = PrefixIndex()
    index.apply("a", [BlockStored(PROMPT, None, None)])
    a, b = worker("a", load=1), worker("b")
    r = router(index)
    assert r.pick(PROMPT, 65, [a, b]).worker is a
    index.forget("a")  # it restarted with an empty pool
    pick = r.pick(PROMPT, 65, [a, b])
    assert pick.worker is b and pick.overlap_blocks == 0


def test_least_loaded_and_round_robin() -> None:
    index = PrefixIndex()
    index.apply("a", [BlockStored(PROMPT, None, None)])
    a, b, c = worker("a", 3), worker("b", 1), worker("c", 2)
    assert router(index, "least-loaded").pick(PROMPT, 65, [a, b, c]).worker is b
    rr = router(index, "round-robin")
    assert [rr.pick(PROMPT, 65, [c, a, b]).worker.worker_id for _ in range(4)] == ["a", "b", "c", "a"]


def test_a_temperature_draws_mostly_the_cheapest() -> None:
    index = PrefixIndex()
    index.apply("a", [BlockStored(PROMPT, None, None)])
    a, b = worker("a"), worker("b")
    r = router(index, temperature=1.0)  # costs 1 and 65: weights 1 and exp(-64/65), a share of 73%
    picks = [r.pick(PROMPT, 65, [a, b]).worker.worker_id for _ in range(200)]
    assert 110 < picks.count("a") < 180  # the other is drawn sometimes, the cheap one mostly
