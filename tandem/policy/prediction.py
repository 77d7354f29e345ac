"""What the predictive planner reasons with: the load it expects, the actions it may take, what a
predictor says each would give, and the record of predictions against what was then measured.

The predictor itself (the simulator run on the forecast load: tandem/sim/predict.py) sits above
this package, so the router only sees the Predictor protocol; the CLI hands one in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

ROLE_KEYS = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class Split:
    """Workers per role."""

    colocated: int = 0
    prefill: int = 0
    decode: int = 0

    @classmethod
    def of(cls, roles: dict[str, int]) -> Split:
        return cls(*(int(roles.get(r, 0)) for r in ROLE_KEYS))

    def moved(self, from_role: str, to_role: str) -> Split:
        counts = {r: getattr(self, r) for r in ROLE_KEYS}
        if from_role:
            counts[from_role] -= 1
        if to_role:
            counts[to_role] += 1
        return Split(**counts)

    @property
    def serves(self) -> bool:
        """Can take a request end to end: something decodes (a decode worker prefills a prompt itself
        when nothing else can), and a prefill worker has a decode worker to hand its requests to."""
        if min(self.colocated, self.prefill, self.decode) < 0:
            return False
        return self.colocated + self.decode > 0 and (self.prefill == 0 or self.decode > 0)

    def describe(self) -> str:
        text = "".join(f"{n}{r[0].upper()}" for r, n in (("prefill", self.prefill), ("decode", self.decode),
                                                           ("colocated", self.colocated)) if n)
        return text or "nothing"


@dataclass(frozen=True)
class Forecast:
    """The next horizon's load: arrivals per second, the (prompt, output) token lengths they draw from,
    and the requests already in flight (prompt, output tokens still to come), which load the
    deployment from its start but are not scored."""

    rate_rps: float
    mix: tuple[tuple[int, int], ...]
    backlog: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class Candidate:
    """One action: a role change, a worker more (empty from_role) or fewer (empty to_role), or none.
    While it is carried out (switch_s: a drain and a start-up), `during` serves."""

    from_role: str
    to_role: str
    after: Split
    during: Split
    switch_s: float = 0.0

    @property
    def is_stay(self) -> bool:
        return not self.from_role and not self.to_role

    def describe(self) -> str:
        if self.is_stay:
            return f"stay at {self.after.describe()}"
        move = (f"{self.from_role} -> {self.to_role}" if self.from_role and self.to_role
                else f"a {self.to_role} worker more" if self.to_role else f"a {self.from_role} worker fewer")
        return f"{move} ({self.after.describe()})"


@dataclass(frozen=True)
class Prediction:
    goodput_rps: float  # requests of the horizon's arrivals meeting both SLOs, per second of the horizon
    ttft_p90_s: float | None = None
    tpot_p90_s: float | None = None
    settle_s: float = 0.0  # after the horizon, how long its last request is predicted to take to finish


class Predictor(Protocol):
    def predict(self, candidate: Candidate, forecast: Forecast, horizon_s: float, seed: int) -> Prediction:
        """The goodput over the next horizon_s were the candidate carried out now."""


@dataclass(frozen=True)
class Question:
    """One predictive decision: the options (staying first) to score on one forecast."""

    at: float
    options: list[Candidate]
    forecast: Forecast
    horizon_s: float
    seed: int  # one draw of the forecast for every option (common random numbers)

    def answer(self, predictor: Predictor) -> list[Prediction]:
        return [predictor.predict(c, self.forecast, self.horizon_s, self.seed) for c in self.options]


def candidates(roles: dict[str, int], moves: list[tuple[str, str]], switch_s: dict[str, float]) -> list[Candidate]:
    """Staying first, then each move (from_role, to_role; an empty side adds or releases a worker) that
    leaves a split able to serve. switch_s: how long a move from a role takes (its worker drains and
    a new one starts; key "": an added worker's start-up); a released worker leaves at once."""
    now = Split.of(roles)
    out = [Candidate("", "", now, now)]
    for src, dst in moves:
        after, during = now.moved(src, dst), now.moved(src, "")
        if after.serves and during.serves:
            out.append(Candidate(src, dst, after, during, switch_s.get(src, 0.0) if dst else 0.0))
    return out


@dataclass
class PredictionRecord:
    t: float
    label: str  # the candidate's description
    acted: bool  # an action carried out, or the planner staying put
    horizon_s: float
    predicted_rps: float
    baseline_rps: float  # what staying was predicted to give
    settle_at: float
    measured_rps: float | None = None

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, once measured."""
        if self.measured_rps is None or self.measured_rps <= 0:
            return None
        return (self.predicted_rps - self.measured_rps) / self.measured_rps

    def view(self, now: float) -> dict:
        return {"age_s": now - self.t, "label": self.label, "acted": self.acted, "horizon_s": self.horizon_s,
                "predicted_goodput": self.predicted_rps, "baseline_goodput": self.baseline_rps,
                "measured_goodput": self.measured_rps, "error": self.error}


@dataclass
class PredictionLog:
    """Predictions waiting for their horizon's requests to finish, then settled against them: the
    requests that arrived within the horizon and met both SLOs, per second of it."""

    kept: int = 50
    records: deque[PredictionRecord] = field(default_factory=deque)
    _finished: deque[tuple[float, bool]] = field(default_factory=deque)  # (arrived, met both SLOs)

    def add(self, record: PredictionRecord) -> None:
        self.records.append(record)
        while len(self.records) > self.kept:
            self.records.popleft()

    def finished(self, arrived_at: float, met: bool) -> None:
        self._finished.append((arrived_at, met))

    def settle(self, now: float) -> list[PredictionRecord]:
        """The records whose horizon has now been measured."""
        done = []
        for r in self.records:
            if r.measured_rps is None and now >= r.settle_at:
                met = sum(ok for t, ok in self._finished if r.t <= t < r.t + r.horizon_s)
                r.measured_rps = met / r.horizon_s
                done.append(r)
        pending = [r.t for r in self.records if r.measured_rps is None]
        oldest = min(pending) if pending else now
        # Requests finish out of arrival order: keep every one a pending horizon may still count.
        self._finished = deque(x for x in self._finished if x[0] >= oldest)
        return done

    def last_settled(self) -> PredictionRecord | None:
        return next((r for r in reversed(self.records) if r.measured_rps is not None), None)

    def view(self, now: float) -> list[dict]:
        return [r.view(now) for r in self.records]
