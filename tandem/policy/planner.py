"""The SLO planner: moves capacity between the prefill and decode sides when one misses its SLO.

Every interval it looks at the requests finished within its window: time to first token is the
prefill side's SLO, time per output token the decode side's. It also forecasts the prompt tokens
arriving over its next interval (a linear trend over the window's arrivals) against the prefill
side's measured capacity, so it adds prefill capacity before a rising load misses TTFT, and never
takes prefill capacity away that the coming load needs.

Roles sit on a ladder: a decode worker only decodes, a prefill worker only prefills, a colocated
worker does both. More prefill: a decode worker becomes colocated (a deployment with colocated
workers) or prefill. More decode: a colocated worker (else a prefill worker) becomes a decode
worker. A side keeps at least one worker able to do its job.

When one side misses while the other has headroom (its p90 well inside its own SLO), it flips one
worker. On an elastic deployment (workers placed by Ray, with room on the cluster) it can also add a
worker where a side misses and no flip can help, and remove one when both sides sit far inside their
SLOs with the forecast load covered by the rest; a scale action is a PlannerAction with an empty
from_role (add) or to_role (remove).

After an action it waits a dwell time, and forgets what it measured before: the new split
is judged on its own requests only, so it never flips back and forth on the same evidence
(Dynamo's 2 <-> 1 replica flapping).

With a Predictor (the simulator on `tandem profile`'s step costs: tandem/sim/predict.py) it predicts
before it acts instead: each interval it forecasts the next dwell time's load (the arrival rate's
trend, the recent requests' prompt and output lengths, the requests in flight), scores staying and
every move the ladder and the launcher allow by the goodput the predictor gives it (a move's drain and
start-up included, the moved worker missing meanwhile), and acts only when the best beats staying by
a margin. Each action's prediction (and, once a horizon, staying's) is settled against the goodput
then measured on the requests that arrived within it (prediction.py's PredictionLog).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tandem.policy.prediction import (
    Candidate,
    Forecast,
    Prediction,
    PredictionLog,
    PredictionRecord,
    Predictor,
    Question,
    candidates,
)

ROLE_ORDER = ("colocated", "decode", "prefill")
ASSUMED_OUTPUT_TOKENS = 256  # a request without max_tokens, before any has finished to say otherwise

@dataclass
class PlannerSettings:
    enabled: bool = False
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    interval_s: float = 5.0
    window_s: float = 60.0  # measurements older than this are forgotten
    dwell_s: float = 120.0  # no action within this long of the last
    headroom: float = 0.5  # the donor side's p90 must be within this fraction of its SLO
    min_samples: int = 8  # per side, in the window, before anything is decided
    max_prefill_load: float = 0.9  # forecast prompt tokens/s over prefill capacity above which it needs more
    idle_headroom: float = 0.25  # elastic: both p90s within this fraction of their SLOs lets a worker go
    # Predictive (with a Predictor): the best move's predicted goodput must beat staying's by this
    # fraction and by min_gain_rps, over a horizon of the dwell time (the least an action holds).
    margin: float = 0.1
    min_gain_rps: float = 0.01
    startup_s: float = 10.0  # a new worker's start-up until it serves, until one has been measured
    # Predictive: the share of one core the simulator may take. The router shares its host's cores
    # with the workers it plans for (all of them, on one machine), so after a decision whose
    # predictions took c CPU seconds the next waits c / cpu_share (never less than the interval).
    cpu_share: float = 0.05


@dataclass(frozen=True)
class PlannerAction:
    at: float
    from_role: str
    to_role: str
    reason: str
    predicted_goodput: float | None = None  # predictive: what the move was predicted to give
    baseline_goodput: float | None = None  # and staying


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)]


def forecast_rate(arrivals: list[tuple[float, float]], now: float, window_s: float, interval_s: float) -> float:
    """Amount per second expected over the next interval: a least-squares line through the window's
    per-interval totals, read at the middle of the next one (never below zero)."""
    bins = max(int(window_s // interval_s), 1)
    totals = np.zeros(bins)
    for t, amount in arrivals:
        i = int((now - t) // interval_s)
        if 0 <= i < bins:
            totals[bins - 1 - i] += amount
    rates = totals / interval_s
    if bins < 3:
        return float(rates.mean())
    x = np.arange(bins, dtype=np.float64)
    slope, intercept = np.polyfit(x, rates, 1)
    return max(float(slope * bins + intercept), 0.0)  # bin i is centred at x = i: the next one at x = bins


def more_prefill(roles: dict[str, int]) -> tuple[str, str] | None:
    if roles.get("decode", 0) < 1:
        return None
    if roles.get("colocated", 0) > 0:
        return "decode", "colocated"  # it still decodes too
    return ("decode", "prefill") if roles["decode"] > 1 else None


def more_decode(roles: dict[str, int]) -> tuple[str, str] | None:
    prefill_capable = roles.get("prefill", 0) + roles.get("colocated", 0)
    if prefill_capable < 2:
        return None
    return ("colocated" if roles.get("colocated", 0) else "prefill"), "decode"


class Planner:
    def __init__(self, settings: PlannerSettings, clock: Callable[[], float] = time.monotonic,
                 predictor: Predictor | None = None) -> None:
        self.settings = settings
        self.clock = clock
        self.predictor = predictor
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()
        self._arrivals: deque[tuple[float, float, int | None]] = deque()  # (time, prompt tokens, max_tokens)
        self._outputs: deque[tuple[float, int]] = deque()  # (time, output tokens) of finished requests
        self._last_action = -float("inf")
        self._decisions = 0
        self._quiet_until = -float("inf")  # predictive: no question before this (the simulator's CPU share)
        self.predict_cpu_s = 0.0  # the simulator's CPU seconds, all decisions together
        self.actions: list[PlannerAction] = []
        self.last_forecast_tok_s = 0.0
        self.predictions = PredictionLog()
        self.last_scores: list[tuple[Candidate, Prediction]] = []  # the last predictive decision's

    def observe(self, ttft_s: float | None, tpot_s: float | None, arrived_at: float | None = None,
                output_tokens: int | None = None) -> None:
        """A request finished with this TTFT and TPOT (None: not measured, e.g. one output token);
        arrived_at (the planner's clock) lets predictions be settled against it."""
        now = self.clock()
        if ttft_s is not None:
            self._ttft.append((now, ttft_s))
        if tpot_s is not None:
            self._tpot.append((now, tpot_s))
        if output_tokens:
            self._outputs.append((now, output_tokens))
        if arrived_at is not None:
            s = self.settings
            met = ttft_s is not None and ttft_s <= s.slo_ttft_s and (tpot_s is None or tpot_s <= s.slo_tpot_s)
            self.predictions.finished(arrived_at, met)

    def observe_arrival(self, prompt_tokens: int, max_tokens: int | None = None) -> None:
        self._arrivals.append((self.clock(), float(prompt_tokens), max_tokens))

    def forecast(self, now: float, backlog: list[tuple[int, int]] = ()) -> Forecast:  # type: ignore[assignment]
        """The next horizon's load: the arrival rate's trend over the window, lengths drawn from the
        latest half of the window's arrivals (all of them when that holds too few), the backlog."""
        s = self.settings
        rate = forecast_rate([(t, 1.0) for t, _, _ in self._arrivals], now, s.window_s, s.interval_s)
        recent = [a for a in self._arrivals if a[0] > now - s.window_s / 2]
        if len(recent) < s.min_samples:
            recent = list(self._arrivals)
        outputs = [n for _, n in self._outputs]
        typical = int(np.median(outputs)) if outputs else ASSUMED_OUTPUT_TOKENS
        mix = tuple((int(p), m or typical) for _, p, m in recent)
        return Forecast(rate, mix, tuple(backlog))

    def _refresh(self, now: float) -> None:
        """Forget what left the window, settle the predictions whose horizon is over, forecast."""
        s = self.settings
        for samples in (self._ttft, self._tpot, self._arrivals, self._outputs):
            while samples and samples[0][0] < now - s.window_s:
                samples.popleft()
        self.predictions.settle(now)
        self.last_forecast_tok_s = forecast_rate([(t, p) for t, p, _ in self._arrivals], now, s.window_s,
                                                 s.interval_s)

    def decide(self, roles: dict[str, int], prefill_capacity_tok_s: float | None = None,
               can_grow: bool = False, can_shrink: bool = False, backlog: list[tuple[int, int]] = (),  # type: ignore[assignment]
               switch_s: dict[str, float] | None = None) -> PlannerAction | None:
        """roles: routable workers per role; prefill_capacity_tok_s: what the prefill-capable ones
        measure together (None: unknown, the forecast is not used); can_grow / can_shrink: the
        launcher can add a worker (room on the cluster) or release one. Predictive only: backlog,
        the requests in flight (prompt tokens, output tokens to come); switch_s, per role, how long
        moving one of its workers takes (its drain and the new worker's start-up)."""
        if self.predictor is not None:
            question = self.ask(roles, can_grow, can_shrink, backlog, switch_s)
            return None if question is None else self.conclude(question, question.answer(self.predictor))
        s = self.settings
        now = self.clock()
        self._refresh(now)
        if now - self._last_action < s.dwell_s or min(len(self._ttft), len(self._tpot)) < s.min_samples:
            return None
        ttft, tpot = p90([v for _, v in self._ttft]), p90([v for _, v in self._tpot])
        load = self.last_forecast_tok_s / prefill_capacity_tok_s if prefill_capacity_tok_s else 0.0
        ttft_room, tpot_room = ttft < s.headroom * s.slo_ttft_s, tpot < s.headroom * s.slo_tpot_s
        action = None
        flip = more_prefill(roles)
        if flip and tpot_room and (ttft > s.slo_ttft_s or load > s.max_prefill_load):
            why = (f"TTFT p90 {ttft * 1e3:.0f} ms misses its SLO {s.slo_ttft_s * 1e3:.0f} ms" if ttft > s.slo_ttft_s
                   else f"forecast prompt load {load:.0%} of prefill capacity")
            action = PlannerAction(now, *flip, f"{why}; TPOT p90 {tpot * 1e3:.0f} ms has room")
        flip = more_decode(roles)
        # Taking a prefill-capable worker away leaves about (n-1)/n of the capacity for the forecast load.
        n = roles.get("prefill", 0) + roles.get("colocated", 0)
        spare = load * n / max(n - 1, 1) < s.max_prefill_load
        if action is None and flip and tpot > s.slo_tpot_s and ttft_room and spare:
            action = PlannerAction(now, *flip, f"TPOT p90 {tpot * 1e3:.0f} ms misses its SLO "
                                   f"{s.slo_tpot_s * 1e3:.0f} ms; TTFT p90 {ttft * 1e3:.0f} ms has room")
        if action is None and can_grow:
            action = self._grow(roles, now, ttft, tpot, load)
        if action is None and can_shrink:
            action = self._shrink(roles, now, ttft, tpot, load, n)
        if action is not None:
            self._acted(action)
        return action

    def _acted(self, action: PlannerAction) -> None:
        self._last_action = action.at
        self._ttft.clear()
        self._tpot.clear()
        self.actions.append(action)

    def moves(self, roles: dict[str, int], can_grow: bool, can_shrink: bool) -> list[tuple[str, str]]:
        """What the predictive planner may do to this split: any one worker's role change (the
        prediction, not a ladder, says which way helps; candidates() drops a split that cannot
        serve), and on an elastic launcher a worker more or fewer of a role. The ladder's moves come
        first: on a tie (2C and 2D simulate alike) the first best is taken."""
        out = [m for m in (more_prefill(roles), more_decode(roles)) if m is not None]
        out += [(src, dst) for src in ROLE_ORDER for dst in ROLE_ORDER
                if src != dst and roles.get(src, 0) > 0 and (src, dst) not in out]
        if can_grow:
            grow = ("colocated",) if not roles.get("prefill") and not roles.get("decode") else ("prefill", "decode")
            out += [("", role) for role in grow]
        if can_shrink:
            out += [(role, "") for role in ("decode", "prefill", "colocated") if roles.get(role, 0) > 0]
        return out

    def ask(self, roles: dict[str, int], can_grow: bool = False, can_shrink: bool = False,
            backlog: list[tuple[int, int]] = (), switch_s: dict[str, float] | None = None  # type: ignore[assignment]
            ) -> Question | None:
        """Predictive: the options to score now and the load to score them on (None: nothing to
        decide yet, within the dwell or on too few arrivals). Answer it (Question.answer: the
        simulator's work, which may run off the event loop), then conclude()."""
        s = self.settings
        now = self.clock()
        self._refresh(now)
        if (now - self._last_action < s.dwell_s or len(self._arrivals) < s.min_samples
                or now < self._quiet_until):
            return None
        switch = {role: (switch_s or {}).get(role, s.startup_s) for role in ("colocated", "prefill", "decode")}
        options = candidates(roles, self.moves(roles, can_grow, can_shrink), {**switch, "": s.startup_s})
        self._decisions += 1
        return Question(now, options, self.forecast(now, list(backlog)), s.dwell_s, self._decisions)

    def conclude(self, question: Question, predictions: list[Prediction], cpu_s: float = 0.0) -> PlannerAction | None:
        """The best option if it beats staying by the margin; every decision's prediction of staying
        (one a horizon) and every action's go to the log, to be settled. cpu_s: what answering the
        question cost (it spaces the next, PlannerSettings.cpu_share)."""
        s, now, horizon = self.settings, question.at, question.horizon_s
        self.predict_cpu_s += cpu_s
        self._quiet_until = now + cpu_s / s.cpu_share if s.cpu_share > 0 else now
        scores = list(zip(question.options, predictions, strict=True))
        self.last_scores = scores
        stay = scores[0][1]
        best, predicted = max(scores[1:], key=lambda cp: cp[1].goodput_rps, default=scores[0])
        gain = predicted.goodput_rps - stay.goodput_rps
        if best.is_stay or gain < max(s.margin * stay.goodput_rps, s.min_gain_rps):
            last = self.predictions.records[-1].t if self.predictions.records else -float("inf")
            if now - last >= horizon:  # staying is a prediction too: one a horizon is settled
                self.predictions.add(PredictionRecord(now, scores[0][0].describe(), False, horizon, stay.goodput_rps,
                                                      stay.goodput_rps, now + horizon + stay.settle_s))
            return None
        reason = (f"{best.describe()}: predicted goodput {predicted.goodput_rps:.3f} req/s over {horizon:.0f} s "
                  f"against {stay.goodput_rps:.3f} staying ({question.forecast.rate_rps:.2f} req/s forecast)")
        action = PlannerAction(now, best.from_role, best.to_role, reason, predicted.goodput_rps, stay.goodput_rps)
        self.predictions.add(PredictionRecord(now, best.describe(), True, horizon, predicted.goodput_rps,
                                              stay.goodput_rps, now + horizon + predicted.settle_s))
        self._acted(action)
        return action

    def _grow(self, roles: dict[str, int], now: float, ttft: float, tpot: float, load: float) -> PlannerAction | None:
        """A side misses and no flip could help: one more worker for it."""
        s = self.settings
        colocated_only = not roles.get("prefill") and not roles.get("decode")
        if ttft > s.slo_ttft_s or load > s.max_prefill_load:
            role = "colocated" if colocated_only else "prefill"
            return PlannerAction(now, "", role, f"TTFT p90 {ttft * 1e3:.0f} ms / prompt load {load:.0%}: "
                                 f"a {role} worker more")
        if tpot > s.slo_tpot_s:
            role = "colocated" if colocated_only else "decode"
            return PlannerAction(now, "", role, f"TPOT p90 {tpot * 1e3:.0f} ms misses its SLO: a {role} worker more")
        return None

    def _shrink(self, roles: dict[str, int], now: float, ttft: float, tpot: float, load: float,
                prefill_capable: int) -> PlannerAction | None:
        """Both sides far inside their SLOs: release a worker (decode first), never the last that can
        prefill or decode, nor prefill capacity the forecast load would miss."""
        s = self.settings
        if ttft > s.idle_headroom * s.slo_ttft_s or tpot > s.idle_headroom * s.slo_tpot_s:
            return None
        decode_capable = roles.get("decode", 0) + roles.get("colocated", 0)
        for role in ("decode", "prefill", "colocated"):
            if roles.get(role, 0) < 1:
                continue
            left_prefill = prefill_capable - (role != "decode")
            left_decode = decode_capable - (role != "prefill")
            if left_prefill < 1 or left_decode < 1:
                continue
            if role != "decode" and load * prefill_capable / left_prefill >= s.max_prefill_load / 2:
                continue
            return PlannerAction(now, role, "", f"TTFT p90 {ttft * 1e3:.0f} ms and TPOT p90 {tpot * 1e3:.0f} ms "
                                 f"far inside their SLOs: a {role} worker fewer")
        return None
