"""`tandem plan`: which deployment serves the most goodput per GPU for a traffic and its SLOs.

DistServe's search. Goodput is the highest request rate at which at least `target` of the requests
meet their SLOs, found by doubling and then bisecting the rate, each probe a simulation whose
arrivals span `span_s` seconds (a short burst would hide a queue that grows without bound).
- A colocated instance (one per tensor-parallel size) is simulated whole, against both SLOs.
- The two phases of a disaggregated deployment are simulated apart, as DistServe does: one prefill
  instance against the TTFT SLO (prompts with max_tokens 1) and one decode instance against the TPOT
  SLO (prompts arriving with their KV; their wait for its blocks held to the TTFT SLO), at each
  tensor-parallel size. P prefill and D decode
  instances then serve min(P x prefill goodput, D x decode goodput); every split within the GPU
  budget is ranked by that over its GPUs.
- The best split is simulated whole at the rate the decomposition gives it, to show what the two
  phases together attain there (the decomposition ignores the transfer and the phases' coupling).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tandem.bench.arrivals import arrival_offsets
from tandem.bench.metrics import meets_slos
from tandem.config import CacheConfig, SchedulerConfig
from tandem.sim.cluster import ClusterSim, Deployment, SimSession, SimTurn
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
        if d.prefill:
            return f"{d.prefill}P(tp{self.tp_prefill}) {d.decode}D(tp{self.tp_decode})"
        if d.decode:
            return f"{d.decode}D(tp{self.tp_decode}) alone"
        return f"{d.colocated}C(tp{self.tp_prefill})"


@dataclass
class PlanRow:
    candidate: Candidate
    goodput: float  # requests/s at the attainment target
    curve: list[tuple[float, float]]  # (rate, attainment) as probed (for a split: its limiting phase's)
    verified: float | None = None  # a split simulated whole at `goodput`: the attainment it reached
    phase: str = ""  # "prefill" / "decode": one instance of that phase alone (DistServe's decomposition)

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput / self.candidate.gpus


def splits(tps: Sequence[int], max_gpus: int, max_instances: int = 4) -> list[Candidate]:
    """P prefill and D decode instances (coprime counts: 2P2D is 1P1D twice) within the GPU budget."""
    out = []
    for tp_p in tps:
        for tp_d in tps:
            for p in range(1, max_instances + 1):
                for d in range(1, max_instances + 1):
                    c = Candidate(Deployment(colocated=0, prefill=p, decode=d, path_policy="disaggregated"), tp_p, tp_d)
                    if math.gcd(p, d) == 1 and c.gpus <= max_gpus:
                        out.append(c)
    return out


def attainment(records: list, slos: dict[str, float]) -> float:
    if not records:
        return 0.0
    return sum(meets_slos(r, slos) for r in records) / len(records)


@dataclass
class Planner:
    """make_cost(role, tp) -> the cost model of one instance; sessions: a pool of distinct requests,
    of which each probe takes as many as its span needs (at least min_requests)."""

    make_cost: Callable[[str, int], CostModel]
    sessions: list[SimSession]
    slos: dict[str, float]
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    max_model_len: int
    target: float = 0.9
    seed: int = 0
    iterations: int = 7
    span_s: float = 10.0
    min_requests: int = 100

    def _at_rate(self, rate: float, sessions: list[SimSession]) -> list[SimSession]:
        n = min(max(math.ceil(rate * self.span_s), self.min_requests), len(sessions))
        offsets = arrival_offsets(n, rate, 1.0, self.seed)
        return [replace(s, start=off) for s, off in zip(sessions[:n], offsets, strict=True)]

    def _simulate(self, deployment: Deployment, costs: dict[str, CostModel], rate: float,
                  sessions: list[SimSession], slos: dict[str, float]) -> float:
        sim = ClusterSim(deployment, costs, self.scheduler_config, self.cache_config, self.max_model_len)
        return attainment(sim.run(self._at_rate(rate, sessions)).records, slos)

    def _bisect(self, meets: Callable[[float], float], start_rate: float) -> tuple[float, list[tuple[float, float]]]:
        """The highest rate whose attainment meets the target: double until it fails, then bisect."""
        curve: list[tuple[float, float]] = []

        def ok(rate: float) -> bool:
            a = meets(rate)
            curve.append((rate, a))
            return a >= self.target

        lo, hi = 0.0, start_rate
        while ok(hi):
            lo, hi = hi, hi * 2
            if hi > 1e6:
                break
        if lo == 0.0:  # even the first rate failed: look below it
            for _ in range(10):
                hi, lo = hi / 2, hi / 4
                if ok(lo):
                    break
            else:
                return 0.0, sorted(curve)
        for _ in range(self.iterations):
            mid = (lo + hi) / 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        return lo, sorted(curve)

    def colocated(self, tp: int, start_rate: float) -> PlanRow:
        c = Candidate(Deployment(colocated=1), tp, tp)
        costs = {"colocated": self.make_cost("colocated", tp)}
        rate, curve = self._bisect(lambda r: self._simulate(c.deployment, costs, r, self.sessions, self.slos),
                                   start_rate * tp)
        return PlanRow(c, rate, curve)

    def prefill_phase(self, tp: int, start_rate: float) -> PlanRow:
        """One prefill instance: every prompt with max_tokens 1, against the TTFT SLO."""
        prompts = [replace(s, turns=[SimTurn(t.prompt, 1, t.category) for t in s.turns]) for s in self.sessions]
        costs = {"colocated": self.make_cost("prefill", tp)}
        slos = {k: v for k, v in self.slos.items() if k == "ttft"}
        rate, curve = self._bisect(lambda r: self._simulate(Deployment(colocated=1), costs, r, prompts, slos),
                                   start_rate * tp)
        return PlanRow(Candidate(Deployment(colocated=1), tp, tp), rate, curve, phase="prefill")

    def decode_phase(self, tp: int, start_rate: float) -> PlanRow:
        """One decode instance: prompts arrive with their KV (a decode pool alone), against the TPOT SLO;
        and the wait for its blocks (here the TTFT: reservation and transfer) within the TTFT SLO, or a
        pool that cannot take requests as fast as they come would pass on TPOT alone."""
        d = Deployment(colocated=0, prefill=0, decode=1)
        costs = {"decode": self.make_cost("decode", tp)}
        slos = dict(self.slos)
        rate, curve = self._bisect(lambda r: self._simulate(d, costs, r, self.sessions, slos), start_rate * tp)
        return PlanRow(Candidate(d, tp, tp), rate, curve, phase="decode")

    def search(self, tps: Sequence[int], max_gpus: int, max_instances: int, start_rate: float,
               progress: Callable[[str], None] = lambda s: None, verify: bool = True) -> list[PlanRow]:
        """Ranked colocated instances and splits; `self.simulated` keeps the rows that were simulated
        (colocated instances, and each phase alone) with their attainment curves."""
        rows: list[PlanRow] = []
        prefill: dict[int, PlanRow] = {}
        decode: dict[int, PlanRow] = {}
        for tp in tps:
            if tp > max_gpus:
                continue
            row = self.colocated(tp, start_rate)
            progress(f"colocated tp{tp}: {row.goodput:.2f} req/s")
            rows.append(row)
            prefill[tp] = self.prefill_phase(tp, start_rate)
            progress(f"prefill instance tp{tp}: {prefill[tp].goodput:.2f} req/s within the TTFT SLO")
            decode[tp] = self.decode_phase(tp, start_rate)
            progress(f"decode instance tp{tp}: {decode[tp].goodput:.2f} req/s within the TPOT SLO")
        self.simulated = [r for r in rows] + list(prefill.values()) + list(decode.values())
        for c in splits(list(prefill), max_gpus, max_instances):
            d = c.deployment
            p_rate, d_rate = d.prefill * prefill[c.tp_prefill].goodput, d.decode * decode[c.tp_decode].goodput
            limiting = prefill[c.tp_prefill] if p_rate <= d_rate else decode[c.tp_decode]
            rows.append(PlanRow(c, min(p_rate, d_rate), limiting.curve))
        rows.sort(key=lambda r: (-r.goodput_per_gpu, r.candidate.gpus))
        best = next((r for r in rows if r.candidate.deployment.prefill), None)
        if verify and best is not None and best.goodput > 0:
            c = best.candidate
            costs = {"prefill": self.make_cost("prefill", c.tp_prefill),
                     "decode": self.make_cost("decode", c.tp_decode)}
            best.verified = self._simulate(c.deployment, costs, best.goodput, self.sessions, self.slos)
            progress(f"{c.describe()} simulated whole at {best.goodput:.2f} req/s: {best.verified:.0%} "
                     "meet both SLOs")
        return rows


def format_table(rows: Sequence[PlanRow], top: int = 15) -> str:
    lines = [f"{'rank':>4}  {'deployment':<22} {'GPUs':>4}  {'goodput req/s':>13}  {'per GPU':>8}"]
    for i, r in enumerate(rows[:top], 1):
        note = "" if r.verified is None else f"  (simulated whole: {r.verified:.0%} attain)"
        lines.append(f"{i:>4}  {r.candidate.describe():<22} {r.candidate.gpus:>4}  {r.goodput:>13.3f}  "
                     f"{r.goodput_per_gpu:>8.3f}{note}")
    return "\n".join(lines)


def plot_curves(phases: Sequence[PlanRow], path: str, title: str, target: float) -> str:
    """Attainment vs rate per GPU of what was simulated: colocated instances and each phase alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in phases:
        tp = r.candidate.tp_decode if r.phase == "decode" else r.candidate.tp_prefill
        names = {"prefill": f"prefill tp{tp} (TTFT)", "decode": f"decode tp{tp} (TPOT)"}
        label = names.get(r.phase, f"colocated tp{tp}")
        ax.plot([rate / tp for rate, _ in r.curve], [a * 100 for _, a in r.curve], marker="o", ms=3, label=label)
    ax.axhline(target * 100, color="grey", ls="--", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("request rate per GPU (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
