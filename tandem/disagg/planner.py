"""The SLO planner: moves capacity between the prefill and decode pools when one misses its SLO.

Every interval it looks at the requests finished within its window: time to first token is the
prefill pool's SLO, time per output token the decode pool's. When one pool's p90 misses its SLO
while the other has headroom (its p90 well inside its own SLO) and more than one worker, it takes a
worker from the one with headroom and gives it to the one that misses. After an action it waits a
dwell time, and forgets what it measured before: the new split is judged on its own requests only,
so it never flips back and forth on the same evidence (Dynamo's 2 <-> 1 replica flapping).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class PlannerSettings:
    enabled: bool = False
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.2
    interval_s: float = 5.0
    window_s: float = 60.0  # measurements older than this are forgotten
    dwell_s: float = 120.0  # no action within this long of the last
    headroom: float = 0.5  # the donor pool's p90 must be within this fraction of its SLO
    min_samples: int = 8  # per pool, in the window, before anything is decided


@dataclass(frozen=True)
class PlannerAction:
    at: float
    from_role: str
    to_role: str
    reason: str


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(int(0.9 * len(ordered)), len(ordered) - 1)]


class Planner:
    def __init__(self, settings: PlannerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self._ttft: deque[tuple[float, float]] = deque()
        self._tpot: deque[tuple[float, float]] = deque()
        self._last_action = -float("inf")
        self.actions: list[PlannerAction] = []

    def observe(self, ttft_s: float | None, tpot_s: float | None) -> None:
        """A request finished with this TTFT and TPOT (None: not measured, e.g. one output token)."""
        now = self.clock()
        if ttft_s is not None:
            self._ttft.append((now, ttft_s))
        if tpot_s is not None:
            self._tpot.append((now, tpot_s))

    def decide(self, num_prefill: int, num_decode: int) -> PlannerAction | None:
        now = self.clock()
        for samples in (self._ttft, self._tpot):
            while samples and samples[0][0] < now - self.settings.window_s:
                samples.popleft()
        s = self.settings
        if now - self._last_action < s.dwell_s or min(len(self._ttft), len(self._tpot)) < s.min_samples:
            return None
        ttft, tpot = p90([v for _, v in self._ttft]), p90([v for _, v in self._tpot])
        action = None
        if ttft > s.slo_ttft_s and tpot < s.headroom * s.slo_tpot_s and num_decode > 1:
            action = PlannerAction(now, "decode", "prefill", f"TTFT p90 {ttft * 1e3:.0f} ms misses its SLO "
                                   f"{s.slo_ttft_s * 1e3:.0f} ms; TPOT p90 {tpot * 1e3:.0f} ms has room")
        elif tpot > s.slo_tpot_s and ttft < s.headroom * s.slo_ttft_s and num_prefill > 1:
            action = PlannerAction(now, "prefill", "decode", f"TPOT p90 {tpot * 1e3:.0f} ms misses its SLO "
                                   f"{s.slo_tpot_s * 1e3:.0f} ms; TTFT p90 {ttft * 1e3:.0f} ms has room")
        if action is not None:
            self._last_action = now
            self._ttft.clear()
            self._tpot.clear()
            self.actions.append(action)
        return action
