"""Checking a tenant's flood before its prompts are tokenized.

Whether a request fits is known only once its prompt is tokenized (and its cached blocks looked up),
and tokenizing a 3,000-token prompt costs the API process about 2 ms on the cores the engine steps
on. A tenant that keeps sending what cannot be served (a flood past capacity, a client that ignores
Retry-After) would make the server tokenize every one of them, slowing every other tenant's
requests. So after STREAK refusals in a row, a tenant's next request is checked before tokenizing
as if it were as large as the smallest of the streak's refused ones, against the load as it is now:
refused there, it is never tokenized; admitted there, it is tokenized and checked in full. One in
PROBE_EVERY is checked in full whatever, so a smaller request gets its own answer; an admitted one
ends the streak, and so does HOLD_S without a refusal, so only a tenant sending several requests a
second is checked this way. Each tenant has its own streak: one tenant's flood never refuses
another's request. Requests without a tenant (no API keys, no tenant header) have none, as their
streak would be everyone's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

STREAK = 8  # refusals in a row before requests are checked as the streak's size
PROBE_EVERY = 8  # while it holds, one request in this many is checked in full
HOLD_S = 1.0  # the streak lapses this long after its last refusal
MAX_TENANTS = 4096  # streaks kept (a tenant header can name any number of tenants): the oldest go first


@dataclass
class _Streak:
    refusals: int = 0
    tokens: int = 0  # the fewest uncached prompt tokens of a refused request in the streak
    skipped: int = 0  # requests checked as the streak's size since the last full check
    at: float = 0.0  # when the last full check refused


class RefusalStreaks:
    def __init__(self, streak: int = STREAK, probe_every: int = PROBE_EVERY, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.streak = streak
        self.probe_every = probe_every
        self.hold_s = hold_s
        self.clock = clock
        self._tenants: dict[str, _Streak] = {}

    def assumed_tokens(self, tenant: str | None) -> int | None:
        """The uncached prompt tokens to check this request with before it is tokenized, or None to
        check it with none then and in full once tokenized."""
        s = self._tenants.get(tenant) if tenant is not None else None
        if s is None or s.refusals < self.streak or self.clock() - s.at > self.hold_s:
            return None
        if s.skipped + 1 >= self.probe_every:
            s.skipped = 0
            return None  # this one is checked in full
        s.skipped += 1
        return s.tokens

    def refusals(self, tenant: str | None) -> int:
        s = self._tenants.get(tenant) if tenant is not None else None
        return s.refusals if s is not None else 0

    def record(self, tenant: str | None, refused: bool, prompt_tokens: int) -> None:
        """The outcome of a full check of a request with prompt_tokens uncached tokens."""
        if tenant is None:
            return
        if not refused:
            self._tenants.pop(tenant, None)
            return
        s = self._tenants.pop(tenant, None)
        if s is None:
            s = _Streak(tokens=prompt_tokens)
        self._tenants[tenant] = s  # the most recently refused last
        while len(self._tenants) > MAX_TENANTS:
            del self._tenants[next(iter(self._tenants))]
        s.refusals += 1
        s.tokens = min(s.tokens, prompt_tokens)
        s.at = self.clock()
