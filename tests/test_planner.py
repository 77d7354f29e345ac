"""The SLO planner on a scripted load and a fake clock: one flip when a pool misses its SLO and the
other has room, none within the dwell time, none without headroom or a spare worker; colocated
workers move along the ladder; the forecast adds prefill capacity before a rising load misses and
keeps it while the load needs it."""

from __future__ import annotations

from fake_clock import Clock

from tandem.policy.planner import Planner, PlannerSettings, forecast_rate

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


def test_colocated_workers_move_along_the_ladder() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    load(planner, clock, ttft=0.2, tpot=0.3)  # prefills stall the decodes of two colocated workers
    action = planner.decide({"colocated": 2})
    assert action is not None and (action.from_role, action.to_role) == ("colocated", "decode")
    clock.now += 61
    load(planner, clock, ttft=2.5, tpot=0.02)  # then long prompts queue: the decode worker goes back
    action = planner.decide({"colocated": 1, "decode": 1})
    assert action is not None and (action.from_role, action.to_role) == ("decode", "colocated")
    clock.now += 61
    load(planner, clock, ttft=0.2, tpot=0.3)
    assert planner.decide({"colocated": 1, "decode": 1}) is None  # the last worker that prefills stays


def test_the_forecast_follows_the_trend() -> None:
    times = [0.05 + 0.1 * i for i in range(600)]  # an arrival every 0.1 s for a minute
    rising = [(t, 10.0 * t) for t in times]  # prompt tokens per second growing by 100 a second
    assert abs(forecast_rate(rising, 60.0, 60.0, 5.0) - 100.0 * 62.5) < 0.02 * 6250  # mid next interval
    steady = forecast_rate([(t, 50.0) for t in times], 60.0, 60.0, 5.0)
    assert abs(steady - 500.0) < 1e-6
    falling = [(t, 10.0 * (60 - t)) for t in times]
    assert forecast_rate(falling, 60.0, 60.0, 5.0) == 0.0  # never below zero


def test_a_rising_prompt_load_adds_prefill_before_ttft_misses_and_keeps_it() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    for _ in range(30):  # TTFT still meets its SLO, but the prompt load is climbing past capacity
        clock.now += 1
        planner.observe_arrival(int(40 * clock.now))
        planner.observe(0.4, 0.02)
    action = planner.decide({"prefill": 1, "decode": 2}, prefill_capacity_tok_s=1000.0)
    assert action is not None and (action.from_role, action.to_role) == ("decode", "prefill")
    assert "forecast prompt load" in action.reason
    # TPOT now misses and TTFT has room, but the forecast load needs both prefill workers: they stay.
    clock.now += 61
    for _ in range(10):
        clock.now += 1
        planner.observe_arrival(1000)
        planner.observe(0.2, 0.3)
    assert planner.decide({"prefill": 2, "decode": 1}, prefill_capacity_tok_s=2000.0) is None
    assert planner.decide({"prefill": 2, "decode": 1}, prefill_capacity_tok_s=8000.0) is not None


def test_an_elastic_deployment_adds_a_worker_where_no_flip_can_help() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    load(planner, clock, ttft=2.5, tpot=0.02)
    # 1P1D: the decode side has room but its only worker cannot go; on a local host nothing happens.
    assert planner.decide({"prefill": 1, "decode": 1}) is None
    action = planner.decide({"prefill": 1, "decode": 1}, can_grow=True)
    assert action is not None and (action.from_role, action.to_role) == ("", "prefill")
    clock.now += 61
    load(planner, clock, ttft=0.2, tpot=0.3)
    action = planner.decide({"prefill": 2, "decode": 1}, can_grow=True)
    # A spare prefill worker exists and TTFT has room: a flip, not a new worker.
    assert action is not None and (action.from_role, action.to_role) == ("prefill", "decode")
    clock.now += 61
    load(planner, clock, ttft=0.9, tpot=0.3)  # TTFT has no room left to give: only a new worker helps
    action = planner.decide({"prefill": 1, "decode": 2}, can_grow=True)
    assert action is not None and (action.from_role, action.to_role) == ("", "decode")
    clock.now += 61
    load(planner, clock, ttft=2.5, tpot=0.02)
    action = planner.decide({"colocated": 1}, can_grow=True)
    assert action is not None and action.to_role == "colocated"


def test_an_idle_elastic_deployment_lets_a_worker_go_but_never_a_sides_last() -> None:
    clock = Clock()
    for roles, expected in [({"prefill": 1, "decode": 2}, "decode"), ({"prefill": 2, "decode": 1}, "prefill"),
                            ({"colocated": 2}, "colocated"), ({"prefill": 1, "decode": 1}, None),
                            ({"colocated": 1}, None), ({"prefill": 1, "colocated": 1}, "prefill")]:
        planner = Planner(SETTINGS, clock)
        load(planner, clock, ttft=0.1, tpot=0.01)  # far inside both SLOs
        action = planner.decide(roles, can_shrink=True)
        assert (action.from_role if action else None) == expected, roles
        if action is not None:
            assert action.to_role == ""
    planner = Planner(SETTINGS, clock)
    load(planner, clock, ttft=0.1, tpot=0.01)
    assert planner.decide({"prefill": 1, "decode": 2}) is None  # not elastic: nothing to release
    load(planner, clock, ttft=0.4, tpot=0.01)  # TTFT not far enough inside
    assert planner.decide({"prefill": 1, "decode": 2}, can_shrink=True) is None
