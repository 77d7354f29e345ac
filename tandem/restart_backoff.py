"""When a process that died is started again: one rule for the engine core and for cluster workers
(docs/reliability.md#restarts). A process that keeps dying soon after it started waits longer each
time, so a crash loop costs little; one that ran a while is back at once."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

RESTART_BACKOFF_S = 1.0  # the first wait
MAX_RESTART_BACKOFF_S = 30.0
YOUNG_S = 60.0  # a process that dies sooner than this after it started doubles the next wait


@dataclass
class RestartBackoff:
    """One process's restart delays: initial_s after a death, doubling per further death within
    young_s of its start, up to max_s; a death after young_s alive starts again from initial_s."""

    initial_s: float = RESTART_BACKOFF_S
    max_s: float = MAX_RESTART_BACKOFF_S
    young_s: float = YOUNG_S
    clock: Callable[[], float] = time.monotonic
    deaths: int = field(default=0, init=False)  # in a row, each young but perhaps the first

    def next_delay(self, started_at: float) -> float:
        """The wait before starting again a process that started at started_at (on clock) and has
        just died."""
        self.deaths = self.deaths + 1 if self.clock() - started_at < self.young_s else 1
        return min(self.initial_s * 2 ** (self.deaths - 1), self.max_s)
