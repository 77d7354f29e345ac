"""The simulator's co-location, speculative decoding and per-request path choice: hand-computed
timelines on linear costs, and the router's path rule decided as the live router decides it."""

from __future__ import annotations

import numpy as np
import pytest

from tandem.config import CacheConfig, SchedulerConfig
from tandem.sim.cluster import ClusterSim, Deployment, SimSession, SimTurn
from tandem.sim.colocation import Neighbours
from tandem.sim.cost import DEFAULT_KNOTS, FittedCost, TransferFit
from tandem.sim.speculation import SpecModel
from tandem.slo import Slo

A, B = 0.010, 0.0005  # a step costs 10 ms plus 0.5 ms a token


def cost(neighbours: Neighbours | None = None) -> FittedCost:
    coefficients = [A, B] + [0.0] * (len(DEFAULT_KNOTS) + 3)
    return FittedCost(coefficients, list(DEFAULT_KNOTS), 1000.0, 4, 1 << 16, {"shm": TransferFit(0.0, 1e12)},
                      "shm", 0.0, min_step_s=0.0, neighbours=neighbours)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, 30000, n).tolist()


def sim(deployment: Deployment, c: FittedCost, sessions: list[SimSession], **options: object):  # noqa: ANN201
    return ClusterSim(deployment, {"colocated": c}, SchedulerConfig(), CacheConfig(), 4096, record_steps=True,
                      **options).run(sessions)  # type: ignore[arg-type]


# A step beside a neighbour's prefill runs at half speed; beside a decode, at full speed.
HALF_BESIDE_PREFILL = Neighbours({"prefill": {"prefill": 1.0, "decode": 0.0},
                                  "decode": {"prefill": 1.0, "decode": 0.0}})


def test_steps_on_one_host_share_it_as_measured():
    sessions = [SimSession([SimTurn(prompt(100, 0), 2)], 0.0), SimSession([SimTurn(prompt(300, 1), 1)], 0.0)]
    res = sim(Deployment(2, routing="round-robin"), cost(HALF_BESIDE_PREFILL), sessions)
    short, long = res.records
    # Both prefill at half speed until the short one's 60 ms of work is done (t = 120 ms); its decode
    # step (10.5 ms of work) then runs beside the long prefill at half speed, while the long prefill
    # runs at full speed beside a decode: its 100 ms left end at 220 ms.
    assert short.ttft == pytest.approx(0.12, abs=1e-12)
    assert short.latency == pytest.approx(0.12 + 2 * (A + B), abs=1e-12)
    assert long.ttft == pytest.approx(0.12 + (A + 300 * B) - 0.06, abs=1e-12)
    assert {w.name: round(w.busy_s, 9) for w in res.instances} == {"c0": round(0.141, 9), "c1": round(0.22, 9)}


def test_instances_on_hosts_of_their_own_do_not_slow_each_other():
    sessions = [SimSession([SimTurn(prompt(100, 0), 2)], 0.0), SimSession([SimTurn(prompt(300, 1), 1)], 0.0)]
    shared = sim(Deployment(2, routing="round-robin"), cost(HALF_BESIDE_PREFILL), sessions)
    apart = sim(Deployment(2, routing="round-robin"), cost(HALF_BESIDE_PREFILL), sessions, instances_per_host=1)
    alone = sim(Deployment(2, routing="round-robin"), cost(), sessions)
    assert [r.ttft for r in apart.records] == pytest.approx([A + 100 * B, A + 300 * B], abs=1e-12)
    assert [r.ttft for r in apart.records] == [r.ttft for r in alone.records]
    assert all(s.ttft > a.ttft for s, a in zip(shared.records, apart.records, strict=True))


def test_a_verification_keeps_the_accepted_drafts():
    one = [SimSession([SimTurn(prompt(100), 9)], 0.0)]
    prefill = A + 100 * B
    every = sim(Deployment(1), cost(), one, spec=SpecModel(3, (1.0,)))
    # Each verification computes the newest token and three drafts and keeps all four.
    assert every.records[0].latency == pytest.approx(prefill + 2 * (A + 4 * B), abs=1e-12)
    none = sim(Deployment(1), cost(), one, spec=SpecModel(3, (0.0,)))
    # Nothing accepted: one token a step; drafts shrink to the room left before max_tokens.
    steps = 5 * (A + 4 * B) + (A + 3 * B) + (A + 2 * B) + (A + B)
    assert none.records[0].latency == pytest.approx(prefill + steps, abs=1e-12)
    assert none.records[0].output_tokens == every.records[0].output_tokens == 9
    half = sim(Deployment(1), cost(), [SimSession([SimTurn(prompt(100, i), 200)], 0.0) for i in range(8)],
               spec=SpecModel(4, (0.5,)))
    (inst,) = half.instances
    assert inst.num_accepted / inst.num_drafts == pytest.approx(SpecModel(4, (0.5,)).mean_accepted(), rel=0.1)
    assert all(r.output_tokens == 200 for r in half.records)


def test_the_draft_model_comes_from_a_runs_counters():
    spec = SpecModel.from_counters(100, 300, [80, 40, 10], 200)
    assert spec is not None
    assert spec.draft_tokens == 3 and spec.accept == pytest.approx((0.8, 0.5, 0.25)) and spec.draft_rate == 0.5
    assert spec.mean_accepted() == pytest.approx(0.8 + 0.4 + 0.1)
    assert SpecModel.from_counters(0, 0, [], 100) is None
    assert SpecModel.parse(2, "0.7,0.4").accept == (0.7, 0.4)
    with pytest.raises(ValueError):
        SpecModel.parse(2, "1.5")


def computed_on(res, rid: str) -> list[str]:  # noqa: ANN001
    """The instances whose steps computed the request's prompt (more than one token of it)."""
    return sorted({w.name for w in res.instances for s in w.steps for r, n in s.scheduled if r == rid and n > 1})


def test_each_request_takes_the_path_the_router_would():
    # A stream decoding on d0; then a 2,000-token prompt (1 s to prefill: spread over its 4 tokens
    # it would stall the stream far past the TPOT SLO) goes through the pair, and a short prompt
    # runs whole on the decode instance (no transfer is worth a tenth of an SLO to it).
    sessions = [SimSession([SimTurn(prompt(16, 0), 400)], 0.0), SimSession([SimTurn(prompt(2000, 1), 4)], 0.5),
                SimSession([SimTurn(prompt(20, 2), 4)], 0.6)]
    slo = Slo(2.0, 0.1)
    res = sim(Deployment(0, 1, 1, path_policy="slo"), cost(), sessions, slo=slo)
    assert computed_on(res, "s0t0") == ["d0"]
    assert computed_on(res, "s1t0") == ["p0"]
    assert computed_on(res, "s2t0") == ["d0"]
    assert all(r.success for r in res.records)
    pinned = sim(Deployment(0, 1, 1, path_policy="disaggregated"), cost(), sessions, slo=slo)
    assert [computed_on(pinned, f"s{i}t0") for i in range(3)] == [["p0"]] * 3


def test_an_unknown_path_policy_is_refused():
    with pytest.raises(ValueError, match="path policy"):
        Deployment(1, path_policy="threshold")
