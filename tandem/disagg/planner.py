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
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


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


@dataclass(frozen=True)
class PlannerAction:
    at: float
    from_role: str
    to_role: str
    reason: str


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
    def __init__(self, settings: PlannerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()
        self._arrivals: deque[tuple[float, float]] = deque()  # (time, prompt tokens)
        self._last_action = -float("inf")
        self.actions: list[PlannerAction] = []
        self.last_forecast_tok_s = 0.0

    def observe(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request finished with this TTFT and TPOT (None: not measured, e.g. one output token)."""
        now = self.clock()
        if ttft_s is not None:
            self._ttft.append((now, ttft_s))
        if tpot_s is not None:
            self._tpot.append((now, tpot_s))

    def observe_arrival(self, prompt_tokens: int) -> None:
        self._arrivals.append((self.clock(), float(prompt_tokens)))

    def decide(self, roles: dict[str, int], prefill_capacity_tok_s: float | None = None,
               can_grow: bool = False, can_shrink: bool = False) -> PlannerAction | None:
        """roles: routable workers per role; prefill_capacity_tok_s: what the prefill-capable ones
        measure together (None: unknown, the forecast is not used); can_grow / can_shrink: the
        launcher can add a worker (room on the cluster) or release one."""
        s = self.settings
        now = self.clock()
        for samples in (self._ttft, self._tpot, self._arrivals):
            while samples and samples[0][0] < now - s.window_s:
                samples.popleft()
        self.last_forecast_tok_s = forecast_rate(list(self._arrivals), now, s.window_s, s.interval_s)
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
            self._last_action = now
            self._ttft.clear()
            self._tpot.clear()
            self.actions.append(action)
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
