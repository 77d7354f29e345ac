"""`tandem plan`: which deployment serves the most goodput per GPU for a traffic and its SLOs.

DistServe's search: for every candidate (colocated instances, or P prefill and D decode instances,
each with its own tensor parallelism), simulate the traffic at increasing rates and find the highest
rate at which at least `attainment` of the requests meet both SLOs; divide by the GPUs it uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.metrics import meets_slos
from tandem.config import CacheConfig, SchedulerConfig
from tandem.sim.cluster import ClusterSim, Deployment, SimSession
from tandem.sim.cost import CostModel


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    tp_prefill: int = 1  # colocated instances use tp_prefill
    tp_decode: int = 1

    @property
    def gpus(self) -> int:
        d = self.deployment
        return d.colocated * self.tp_prefill + d.prefill * self.tp_prefill + d.decode * self.tp_decode

    def describe(self) -> str:
        d = self.deployment
        if d.is_disaggregated:
            return f"{d.prefill}P(tp{self.tp_prefill}) {d.decode}D(tp{self.tp_decode})"
        return f"{d.colocated}C(tp{self.tp_prefill})"


@dataclass
class PlanRow:
    candidate: Candidate
    goodput: float  # requests/s at the attainment target
    curve: list[tuple[float, float]]  # (rate, attainment) as probed

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.candidate.gpus


def candidates(tps: Sequence[int], max_gpus: int, max_instances: int = 4) -> list[Candidate]:
    out = []
    for tp in tps:
        if tp <= max_gpus:
            out.append(Candidate(Deployment(colocated=1), tp, tp))
    for tp_p in tps:
        for tp_d in tps:
            for p in range(1, max_instances + 1):
                for d in range(1, max_instances + 1):
                    if math.gcd(p, d) != 1:
                        continue  # 2P2D is 1P1D twice: the same goodput per GPU
                    c = Candidate(Deployment(colocated=0, prefill=p, decode=d), tp_p, tp_d)
                    if c.gpus <= max_gpus:
                        out.append(c)
    return out


def attainment(sim_records: list, slos: dict[str, float]) -> float:
    if not sim_records:
        return 0.0
    return sum(meets_slos(r, slos) for r in sim_records) / len(sim_records)


@dataclass
class Planner:
    """make_cost(role, tp) -> the cost model of one instance; turns: the traffic, whose arrival times
    are drawn anew (Poisson, seeded) at each rate probed."""

    make_cost: Callable[[str, int], CostModel]
    sessions: list[SimSession]
    slos: dict[str, float]
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    max_model_len: int
    target: float = 0.9
    seed: int = 0
    iterations: int = 7

    def _at_rate(self, rate: float) -> list[SimSession]:
        offsets = arrival_offsets(len(self.sessions), rate, 1.0, self.seed)
        return [SimSession(s.turns, off, s.think_times) for s, off in zip(self.sessions, offsets, strict=True)]

    def attainment(self, c: Candidate, rate: float) -> float:
        d = c.deployment
        costs = {"colocated": self.make_cost("colocated", c.tp_prefill)}
        if d.is_disaggregated:
            costs = {"prefill": self.make_cost("prefill", c.tp_prefill),
                     "decode": self.make_cost("decode", c.tp_decode)}
        sim = ClusterSim(d, costs, self.scheduler_config, self.cache_config, self.max_model_len)
        return attainment(sim.run(self._at_rate(rate)).records, self.slos)

    def goodput(self, c: Candidate, start_rate: float) -> PlanRow:
        """The highest rate meeting the target: double until it fails, then bisect."""
        curve: list[tuple[float, float]] = []

        def ok(rate: float) -> bool:
            a = self.attainment(c, rate)
            curve.append((rate, a))
            return a >= self.target

        lo, hi = 0.0, start_rate * c.gpus
        while ok(hi):
            lo, hi = hi, hi * 2
            if hi > 1e6:
                break
        if lo == 0.0:  # even the first rate failed: look below it
            hi_fail = hi
            lo = hi_fail / 2
            for _ in range(8):
                if ok(lo):
                    break
                hi_fail, lo = lo, lo / 2
            else:
                return PlanRow(c, 0.0, sorted(curve))
            hi = hi_fail
        for _ in range(self.iterations):
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return PlanRow(c, lo, sorted(curve))

    def search(self, cands: Sequence[Candidate], start_rate: float,
               progress: Callable[[str], None] = lambda s: None) -> list[PlanRow]:
        rows = []
        for i, c in enumerate(cands):
            row = self.goodput(c, start_rate)
            progress(f"[{i + 1}/{len(cands)}] {c.describe()}: {row.goodput:.2f} req/s, "
                     f"{row.goodput_per_gpu:.3f} per GPU")
            rows.append(row)
        return sorted(rows, key=lambda r: (-r.goodput_per_gpu, r.candidate.gpus))


def format_table(rows: Sequence[PlanRow], top: int = 15) -> str:
    lines = [f"{'rank':>4}  {'deployment':<22} {'GPUs':>4}  {'goodput req/s':>13}  {'per GPU':>8}"]
    for i, r in enumerate(rows[:top], 1):
        lines.append(f"{i:>4}  {r.candidate.describe():<22} {r.candidate.gpus:>4}  {r.goodput:>13.3f}  "
                     f"{r.goodput_per_gpu:>8.3f}")
    return "\n".join(lines)


def plot_curves(rows: Sequence[PlanRow], path: str, title: str, target: float, top: int = 6) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows[:top]:
        rates = [rate / r.candidate.gpus for rate, _ in r.curve]
        ax.plot(rates, [a * 100 for _, a in r.curve], marker="o", ms=3, label=r.candidate.describe())
    ax.axhline(target * 100, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("request rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
