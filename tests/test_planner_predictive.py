"""The predictive planner on a fake clock, driven by the simulator: it takes the move the simulator
shows to be best, refuses the flip the reactive rules would make where the new split loses, holds
through its dwell and its margin, prices a move's drain, and settles each prediction against the
goodput measured on the requests that arrived within its horizon."""

from __future__ import annotations

import pytest
from fake_clock import Clock
from prometheus_client import CollectorRegistry

from tandem.cli.cluster import planner_profiles
from tandem.config import CacheConfig, SchedulerConfig
from tandem.disagg.router.metrics import ClusterSnapshot, DisaggMetrics
from tandem.disagg.router.settings import RouterCounters
from tandem.policy.planner import Planner, PlannerSettings
from tandem.policy.prediction import Candidate, Forecast, Prediction, Split, candidates
from tandem.sim.cluster import ClusterSim, Deployment, SimSession, SimTurn
from tandem.sim.cost import DEFAULT_KNOTS, FittedCost, TransferFit
from tandem.sim.predict import SimPredictor
from tandem.slo import Slo

SLO = Slo(ttft_s=6.0, tpot_s=0.15)
SETTINGS = PlannerSettings(enabled=True, slo_ttft_s=SLO.ttft_s, slo_tpot_s=SLO.tpot_s, interval_s=2, window_s=20,
                           dwell_s=30, min_samples=4)


def cost(per_step: float, per_token: float) -> FittedCost:
    """A step costs per_step plus per_token for each token it computes."""
    coefficients = [per_step, per_token] + [0.0] * (len(DEFAULT_KNOTS) + 3)
    return FittedCost(coefficients, list(DEFAULT_KNOTS), 1000.0, 4, 1 << 16, {"shm": TransferFit(1e-3, 1e9)}, "shm",
                      0.0, min_step_s=0.0, engine={"max_num_batched_tokens": 512})


# One core prefilling a 768-token prompt in ~3 s; decoding is cheap next to it.
PREFILL_BOUND = cost(0.005, 0.004)
# Decoding costs by the tokens it computes (a CPU at float32): two decoders beat one.
COMPUTE_BOUND = cost(0.002, 0.006)


def arrivals(planner: Planner, clock: Clock, rate: float, prompt: int, output: int, seconds: float) -> None:
    step = 1 / rate
    for _ in range(int(seconds * rate)):
        clock.now += step
        planner.observe_arrival(prompt, output)


def test_the_move_the_simulator_shows_best_is_taken() -> None:
    """Long prompts at 0.5/s, one token out (a classifier's load), need both cores prefilling: one
    prefiller (1C1D, every prompt through the pair: --path-policy disaggregated) falls behind on TTFT."""
    clock = Clock()
    planner = Planner(SETTINGS, clock, SimPredictor({"colocated": PREFILL_BOUND}, SLO, "disaggregated"))
    arrivals(planner, clock, rate=0.5, prompt=768, output=1, seconds=20)
    action = planner.decide({"colocated": 1, "decode": 1})
    assert action is not None and (action.from_role, action.to_role) == ("decode", "colocated")
    scores = {c.describe(): p.goodput_rps for c, p in planner.last_scores}
    assert set(scores) == {"stay at 1D1C", "decode -> colocated (2C)", "colocated -> decode (2D)",
                           "colocated -> prefill (1P1D)"}  # 1P1C cannot serve: no decode worker for the prefills
    assert action.predicted_goodput == max(scores.values()) == scores["decode -> colocated (2C)"]
    assert scores["colocated -> prefill (1P1D)"] < scores["decode -> colocated (2C)"]  # still one prefiller
    assert action.predicted_goodput >= 1.1 * action.baseline_goodput
    assert "predicted goodput" in action.reason
    [record] = planner.predictions.records
    assert record.acted and record.predicted_rps == action.predicted_goodput and record.measured_rps is None


def test_under_the_slo_path_policy_a_decode_worker_prefills_too_so_nothing_moves() -> None:
    """The same load under the router's default path policy: the decode worker runs the prompts it
    can finish in time whole, so 1D1C prefills on both cores and already beats the move (which
    leaves a worker missing while it switches)."""
    clock = Clock()
    planner = Planner(SETTINGS, clock, SimPredictor({"colocated": PREFILL_BOUND}, SLO, "slo"))
    arrivals(planner, clock, rate=0.5, prompt=768, output=1, seconds=20)
    assert planner.decide({"colocated": 1, "decode": 1}) is None
    scores = {c.describe(): p.goodput_rps for c, p in planner.last_scores}
    pinned = Planner(SETTINGS, Clock(), SimPredictor({"colocated": PREFILL_BOUND}, SLO, "disaggregated"))
    arrivals(pinned, pinned.clock, rate=0.5, prompt=768, output=1, seconds=20)  # type: ignore[arg-type]
    pinned.decide({"colocated": 1, "decode": 1})
    through_the_pair = {c.describe(): p.goodput_rps for c, p in pinned.last_scores}
    assert scores["stay at 1D1C"] == max(scores.values()) > 2 * through_the_pair["stay at 1D1C"]


def test_a_flip_the_reactive_rules_would_make_is_refused_when_the_new_split_loses() -> None:
    """Short prompts, long answers, TPOT missing on 2C: the reactive planner moves a worker to decode;
    the simulator shows one decoder (every prompt through the pair) doing worse than two, so the
    predictive planner stays."""
    reactive, predictive = Planner(SETTINGS, Clock()), Planner(SETTINGS, Clock(), SimPredictor(
        {"colocated": COMPUTE_BOUND}, SLO, "disaggregated"))
    for planner in (reactive, predictive):
        clock = planner.clock
        assert isinstance(clock, Clock)
        for _ in range(12):
            arrivals(planner, clock, rate=1.0, prompt=64, output=192, seconds=1)
            planner.observe(0.4, 0.2)  # TPOT p90 past its 150 ms SLO, TTFT well inside
    flip = reactive.decide({"colocated": 2})
    assert flip is not None and (flip.from_role, flip.to_role) == ("colocated", "decode")
    assert predictive.decide({"colocated": 2}) is None
    scores = {c.describe(): p.goodput_rps for c, p in predictive.last_scores}
    assert scores["colocated -> decode (1D1C)"] < scores["stay at 2C"]
    [stay] = predictive.predictions.records  # staying is recorded as a prediction, to be settled
    assert not stay.acted and stay.predicted_rps == scores["stay at 2C"]


def test_a_drain_longer_than_the_horizon_makes_a_winning_move_lose() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock, SimPredictor({"colocated": PREFILL_BOUND}, SLO, "disaggregated"))
    arrivals(planner, clock, rate=0.5, prompt=768, output=1, seconds=20)
    drains = dict.fromkeys(("colocated", "decode"), 10 * SETTINGS.dwell_s)
    assert planner.decide({"colocated": 1, "decode": 1}, switch_s=drains) is None
    scores = {c.describe(): p.goodput_rps for c, p in planner.last_scores}
    assert scores["decode -> colocated (2C)"] <= scores["stay at 1D1C"]


class Scripted:
    """A predictor whose answer per split is given: the planner's own rules, apart from the simulator."""

    def __init__(self, goodput: dict[str, float]) -> None:
        self.goodput = goodput

    def predict(self, candidate: Candidate, forecast: Forecast, horizon_s: float, seed: int) -> Prediction:
        return Prediction(self.goodput.get(candidate.after.describe(), 0.0))


def test_dwell_and_margin_hold() -> None:
    clock = Clock()
    predictor = Scripted({"2C": 1.0, "1D1C": 1.05})
    planner = Planner(SETTINGS, clock, predictor)
    arrivals(planner, clock, rate=1.0, prompt=64, output=64, seconds=20)
    assert planner.decide({"colocated": 2}) is None  # 5% better: inside the 10% margin
    predictor.goodput["1D1C"] = 1.2
    action = planner.decide({"colocated": 2})
    assert action is not None and (action.from_role, action.to_role) == ("colocated", "decode")
    # Within the dwell nothing moves, however much better the way back is predicted to be.
    predictor.goodput["2C"] = 5.0
    for _ in range(10):
        arrivals(planner, clock, rate=1.0, prompt=64, output=64, seconds=2)
        assert planner.decide({"colocated": 1, "decode": 1}) is None
    clock.now = action.at + SETTINGS.dwell_s
    back = planner.decide({"colocated": 1, "decode": 1})
    assert back is not None and (back.from_role, back.to_role) == ("decode", "colocated")


def test_a_prediction_is_settled_against_the_goodput_its_horizon_measured() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock, Scripted({"2C": 1.0, "1D1C": 2.0}))
    arrivals(planner, clock, rate=1.0, prompt=64, output=64, seconds=20)
    action = planner.decide({"colocated": 2})
    assert action is not None
    t0 = action.at
    # Over the horizon: 30 arrivals, 21 meet both SLOs, 6 miss TPOT, 3 miss TTFT; one from before counts not.
    planner.observe(0.1, 0.01, arrived_at=t0 - 1)
    for i in range(30):
        ttft, tpot = (0.5, 0.05) if i < 21 else (0.5, 0.5) if i < 27 else (60.0, 0.05)
        planner.observe(ttft, tpot, arrived_at=t0 + i)
    clock.now = t0 + SETTINGS.dwell_s - 1
    planner.decide({"colocated": 1, "decode": 1})
    [record] = [r for r in planner.predictions.records if r.acted]
    assert record.measured_rps is None  # its horizon is not over
    clock.now = t0 + SETTINGS.dwell_s + 1
    planner.decide({"colocated": 1, "decode": 1})
    assert record.measured_rps == pytest.approx(21 / SETTINGS.dwell_s)
    assert record.error == pytest.approx((2.0 - 0.7) / 0.7)
    assert planner.predictions.last_settled() is record


def test_decisions_are_spaced_to_keep_the_simulator_within_its_cpu_share() -> None:
    """A decision whose predictions took 0.5 CPU seconds, at a 5% share, holds the next for 10 s."""
    clock = Clock()
    planner = Planner(SETTINGS, clock, Scripted({"2C": 1.0}))
    arrivals(planner, clock, rate=1.0, prompt=64, output=64, seconds=20)
    question = planner.ask({"colocated": 2})
    assert question is not None
    assert planner.conclude(question, question.answer(planner.predictor), cpu_s=0.5) is None
    clock.now += 9.5
    assert planner.ask({"colocated": 2}) is None
    clock.now += 0.5
    assert planner.ask({"colocated": 2}) is not None
    assert planner.predict_cpu_s == 0.5


def test_the_forecast_draws_lengths_from_the_latest_arrivals_and_carries_the_backlog() -> None:
    clock = Clock()
    planner = Planner(SETTINGS, clock)
    arrivals(planner, clock, rate=1.0, prompt=768, output=8, seconds=10)
    arrivals(planner, clock, rate=1.0, prompt=64, output=192, seconds=10)
    planner.observe_arrival(100)  # no max_tokens, and nothing finished yet to say how long answers run
    f = planner.forecast(clock.now, [(500, 20)])
    assert set(f.mix) == {(64, 192), (100, 256)}  # the latest half of the window only
    assert f.backlog == ((500, 20),)
    assert f.rate_rps == pytest.approx(1.0, rel=0.3)


def test_moves_keep_a_split_that_serves() -> None:
    options = candidates({"prefill": 1, "decode": 1}, [("decode", "prefill"), ("prefill", "decode"), ("", "decode")],
                         {"decode": 5.0, "prefill": 5.0, "": 2.0})
    # Two prefill workers have nobody to hand their requests to; two decode workers prefill for themselves.
    assert [(c.from_role, c.to_role, c.switch_s) for c in options] == [
        ("", "", 0.0), ("prefill", "decode", 5.0), ("", "decode", 2.0)]
    assert options[1].after == Split(decode=2) and options[1].during == Split(decode=1)
    assert options[2].after == Split(prefill=1, decode=2) and options[2].during == Split(prefill=1, decode=1)


def test_a_worker_that_joins_late_gets_nothing_before_it_joins() -> None:
    # Four overlapping requests before it joins (least-loaded routing would spread them), two after.
    sessions = [SimSession([SimTurn(list(range(2, 34)), 100)], t) for t in (0.0, 0.5, 1.0, 1.5, 6.0, 6.5)]
    sim = ClusterSim(Deployment.parse("2C"), {"colocated": cost(0.01, 0.001)}, SchedulerConfig(),
                     CacheConfig(enable_prefix_caching=False), 4096, record_steps=True, joins_at={"c1": 5.0})
    res = sim.run(sessions)
    assert all(r.success for r in res.records)
    early, late = res.instances
    assert late.name == "c1" and late.steps and min(s.start for s in late.steps) >= 6.0
    assert min(s.start for s in early.steps) == 0.0


def test_the_last_settled_prediction_is_exported() -> None:
    registry = CollectorRegistry()
    DisaggMetrics(registry, "m").collect(ClusterSnapshot([], RouterCounters(), 0, {}, 0.0, (1.25, 0.75)))
    assert registry.get_sample_value("tandem:router_planner_predicted_goodput", {"model_name": "m"}) == 1.25
    assert registry.get_sample_value("tandem:router_planner_measured_goodput", {"model_name": "m"}) == 0.75


def test_planner_profile_flags() -> None:
    assert planner_profiles(["w.json"]) == dict.fromkeys(("colocated", "prefill", "decode"), "w.json")
    assert planner_profiles(["w.json", "decode=d.json"])["decode"] == "d.json"
    assert planner_profiles(["prefill=p.json"]) == {"prefill": "p.json", "colocated": "p.json"}
    with pytest.raises(ValueError, match="the role is one of"):
        planner_profiles(["prefil=p.json"])
