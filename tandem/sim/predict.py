"""The planner's predictor: the simulator run on the forecast load, for each split the planner weighs.

A prediction draws the horizon's arrivals from the forecast (Poisson at its rate, lengths from its
mix; one draw per seed, so every option of a decision meets the same requests), puts the requests
in flight at the start, and simulates the deployment the option leaves, with the worker it moves
missing for the switch and its replacement joining after it. The goodput is that of the horizon's
own arrivals: those meeting both SLOs, per second of the horizon.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tandem.config import CacheConfig, SchedulerConfig
from tandem.policy.prediction import Candidate, Forecast, Prediction, Split
from tandem.sim.cluster import ClusterSim, Deployment, SimSession, SimTurn
from tandem.sim.cost import CostModel, load_profile
from tandem.sim.run import engine_configs
from tandem.slo import Slo

NEW, BACKLOG = "new", "backlog"
VOCAB = (2, 30000)  # random prompt ids: nothing the draw holds shares a prefix by chance


class SimPredictor:
    def __init__(self, costs: dict[str, CostModel], slo: Slo, path_policy: str = "slo",
                 max_requests: int = 400) -> None:
        if "colocated" not in costs:
            raise ValueError("the predictor needs a profile for colocated workers (every role's default)")
        self.costs, self.slo = costs, slo
        self.path_policy, self.max_requests = path_policy, max_requests
        sched, cache, self.max_model_len = engine_configs(costs["colocated"].engine, {}, False)
        self.sched: SchedulerConfig = sched
        self.cache = CacheConfig(block_size=cache.block_size, enable_prefix_caching=False)

    @classmethod
    def from_profiles(cls, paths: dict[str, str | Path], slo: Slo, path_policy: str = "slo") -> SimPredictor:
        """path_policy as the router's: "disaggregated" sends every prompt through a pair when there is
        one; "slo" picks each request's path by its predicted TTFT and TPOT, as the router does."""
        return cls({role: load_profile(p) for role, p in paths.items()}, slo, path_policy)

    def draw(self, forecast: Forecast, horizon_s: float, seed: int) -> list[SimSession]:
        rng = np.random.default_rng(seed)
        limit = self.max_model_len - 1

        def session(prompt_len: int, output: int, start: float, category: str) -> SimSession:
            prompt_len = max(1, min(prompt_len, limit - 1))
            output = max(1, min(output, limit - prompt_len))
            return SimSession([SimTurn(rng.integers(*VOCAB, prompt_len).tolist(), output, category)], start)

        out = [session(p, left, 0.0, BACKLOG) for p, left in forecast.backlog]
        if not forecast.mix or forecast.rate_rps <= 0:
            return out
        t = rng.exponential(1 / forecast.rate_rps)
        while t < horizon_s and len(out) < self.max_requests:
            p, n = forecast.mix[int(rng.integers(len(forecast.mix)))]
            out.append(session(p, n, t, NEW))
            t += rng.exponential(1 / forecast.rate_rps)
        return out

    def predict(self, candidate: Candidate, forecast: Forecast, horizon_s: float, seed: int) -> Prediction:
        sessions = self.draw(forecast, horizon_s, seed)
        if not any(s.turns[0].category == NEW for s in sessions):
            return Prediction(0.0)
        split, joins = candidate.after, {}
        deployment = deployment_of(split, self.path_policy)
        if candidate.to_role and candidate.switch_s > 0:
            # The new worker is the last of its role; until it joins, `during` serves.
            role = candidate.to_role if deployment.colocated == split.colocated else "colocated"
            joins[f"{role[0]}{getattr(deployment, role) - 1}"] = candidate.switch_s
        sim = ClusterSim(deployment, self.costs, self.sched, self.cache, self.max_model_len, joins_at=joins,
                         slo=self.slo)
        records = [r for r in sim.run(sessions).records if r.category == NEW]
        met = [r for r in records if r.success and r.ttft <= self.slo.ttft_s
               and (r.tpot is None or r.tpot <= self.slo.tpot_s)]
        done = [r for r in records if r.success]
        ttfts = [r.ttft for r in done]
        tpots = [r.tpot for r in done if r.tpot is not None]
        settle = max((r.start + r.latency for r in done), default=horizon_s) - horizon_s
        return Prediction(len(met) / horizon_s, float(np.percentile(ttfts, 90)) if ttfts else None,
                          float(np.percentile(tpots, 90)) if tpots else None, max(settle, 0.0))


def deployment_of(split: Split, path_policy: str) -> Deployment:
    """The simulator's deployment for a split. Decode workers alone prefill their prompts themselves,
    as colocated instances do. (Prefill workers without a decode worker hand their requests to nobody:
    such a split cannot serve, and the planner never leaves one.)"""
    if split.colocated + split.prefill == 0:
        return Deployment(split.decode, path_policy=path_policy)
    return Deployment(split.colocated, split.prefill, split.decode, path_policy=path_policy)
