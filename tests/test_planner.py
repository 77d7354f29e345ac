"""The SLO planner on a scripted load and a fake clock: one flip when a pool misses its SLO and the
other has room, none within the dwell time, none without headroom or a spare worker."""

from __future__ import annotations

from tandem.disagg.planner import Planner, PlannerSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


SETTINGS = PlannerSettings(enabled=True, slo_ttft_s=1.0, slo_tpot_s=0.1, window_s=30, dwell_s=60, min_samples=4)


def load(planner: Planner, clock: Clock, ttft: float, tpot: float, seconds: float = 10) -> None:
    for _ in range(int(seconds)):
        clock.now += 1
        planner.observe(ttft, tpot)


def test_a_missed_ttft_slo_flips_one_decode_worker_once_within_the_dwell() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    load(planner, clock, ttft=2.5, tpot=0.02)  # prompts queue, decoding has plenty of room
    action = planner.decide({"prefill": 1, "decode": 2})
    assert action is not None and (action.from_role, action.to_role) == ("decode", "prefill")
    assert "TTFT p90 2500 ms" in action.reason
    # The same pressure within the dwell time: nothing, however long it lasts.
    for _ in range(5):
        load(planner, clock, ttft=2.5, tpot=0.02)
        assert planner.decide({"prefill": 2, "decode": 1}) is None
    assert len(planner.actions) == 1


def test_a_missed_tpot_slo_flips_a_prefill_worker() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    load(planner, clock, ttft=0.2, tpot=0.3)
    action = planner.decide({"prefill": 2, "decode": 1})
    assert action is not None and (action.from_role, action.to_role) == ("prefill", "decode")


def test_no_flip_without_headroom_or_a_spare_worker_or_enough_samples() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    load(planner, clock, ttft=2.5, tpot=0.08)  # both pools near or past their SLOs: moving helps nobody
    assert planner.decide({"prefill": 1, "decode": 2}) is None
    load(planner, clock, ttft=2.5, tpot=0.02, seconds=40)
    assert planner.decide({"prefill": 1, "decode": 1}) is None  # the decode pool's last worker stays
    fresh = Planner(SETTINGS, clock)
    load(fresh, clock, ttft=2.5, tpot=0.02, seconds=2)
    assert fresh.decide({"prefill": 1, "decode": 2}) is None  # too little evidence


def test_after_the_dwell_it_judges_the_new_split_on_new_requests_only() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    load(planner, clock, ttft=2.5, tpot=0.02)
    assert planner.decide({"prefill": 1, "decode": 3}) is not None
    clock.now += 61  # past the dwell, but nothing measured since the flip
    assert planner.decide({"prefill": 2, "decode": 2}) is None
    load(planner, clock, ttft=0.3, tpot=0.02)  # the new split meets both SLOs: it stays
    assert planner.decide({"prefill": 2, "decode": 2}) is None
