"""What a worker's reports say about its speed: how fast it prefills, how long its decode steps take,
how much of a KV transfer shows on its critical path, and how much prompt work is queued there.
The path choice (paths.py) predicts from one worker's; admission (deadlines.py, through fleet_shape)
from the fleet's, as one engine.

Measured from the differences between successive stats reports (so a worker's early history fades),
smoothed with an exponential moving average. Until a worker has measured something, the mean of the
workers that have stands in for it (same model, similar cores), else a conservative prior.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from tandem.engine.core_report import CoreStats
from tandem.policy.deadlines import EngineShape

ALPHA = 0.3  # weight of the newest measurement
PRIOR_PREFILL_TOK_S = 500.0
PRIOR_STEP_S = 0.05


class TransferCounters(Protocol):
    transfers_ok: int  # KV transfers sent whole
    exposed_s: float  # seconds of them a prefill's critical path waited


class Report(Protocol):
    """A worker's stats report (disagg's WorkerStats), as far as its speed is concerned."""

    @property
    def core(self) -> CoreStats: ...

    @property
    def transfer(self) -> TransferCounters: ...


def _ewma(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new


@dataclass
class WorkerRates:
    prefill_tok_s: float | None = None  # prompt tokens per second of the steps that computed them
    step_s: float | None = None  # a decode step (prompt chunks sharing it included): the time between tokens
    exposed_transfer_s: float | None = None  # per transfer sent: what the prefill's critical path waited
    queued_prompt_tokens: int = 0  # as last reported
    decoding: int = 0  # requests decoding there, as last reported
    sent_prompt_tokens: int = 0  # routed here since that report (the report cannot know of them yet)
    _last: Report | None = None

    def observe(self, stats: Report) -> None:
        last, self._last = self._last, stats
        self.queued_prompt_tokens = stats.core.num_waiting_prompt_tokens
        self.decoding = stats.core.num_decoding
        self.sent_prompt_tokens = 0
        if last is None:
            return
        c, p = stats.core, last.core
        tokens, busy = c.num_computed_prompt_tokens - p.num_computed_prompt_tokens, c.prompt_busy_s - p.prompt_busy_s
        if tokens > 0 and busy > 0:
            self.prefill_tok_s = _ewma(self.prefill_tok_s, tokens / busy)
        steps, decode_s = c.num_decode_steps - p.num_decode_steps, c.decode_busy_s - p.decode_busy_s
        if steps > 0 and decode_s > 0:
            self.step_s = _ewma(self.step_s, decode_s / steps)
        t, u = stats.transfer, last.transfer
        sent = t.transfers_ok - u.transfers_ok
        if sent > 0:
            self.exposed_transfer_s = _ewma(self.exposed_transfer_s, (t.exposed_s - u.exposed_s) / sent)

    @property
    def queued(self) -> int:
        return self.queued_prompt_tokens + self.sent_prompt_tokens


@dataclass(frozen=True)
class Speed:
    """One worker's figures, with the fleet's standing in for what it has not measured."""

    prefill_tok_s: float
    step_s: float
    exposed_transfer_s: float
    queued_prompt_tokens: int
    decoding: int = 0


def fleet_speed(rates: WorkerRates, fleet: Iterable[WorkerRates]) -> Speed:
    fleet = list(fleet)

    def measured(name: str, prior: float) -> float:
        own = getattr(rates, name)
        if own is not None:
            return own
        others = [getattr(r, name) for r in fleet if getattr(r, name) is not None]
        return sum(others) / len(others) if others else prior

    return Speed(measured("prefill_tok_s", PRIOR_PREFILL_TOK_S), measured("step_s", PRIOR_STEP_S),
                 measured("exposed_transfer_s", 0.0), rates.queued, rates.decoding)


@dataclass(frozen=True)
class RateSteps:
    """A step from measured rates rather than a start-up profile (deadlines.StepModel): a decode step
    when any row decodes, plus the prompt tokens at the prompt rate. A cluster's router has these
    (its workers report counters, not step profiles)."""

    prefill_tok_s: float
    decode_step_s: float

    def parts(self, decode_rows: float, prompt_tokens: float) -> tuple[float, float]:
        return self.decode_step_s if decode_rows > 0 else 0.0, max(prompt_tokens, 0.0) / self.prefill_tok_s


def fleet_shape(prompt: list[Speed], decode: list[Speed], budget: int, seats: int,
                contended_chunk: int) -> EngineShape | None:
    """A fleet as one engine, for admission's predictions (the same as a single server's): the workers
    that compute prompts add their prompt rates and step budgets (each fills its own steps), a decode
    step takes the decode workers' mean step time, and seats are the decode workers' (seats). None
    without workers. The rates are live measurements, so the factor is 1."""
    if not prompt or not decode:
        return None
    steps = RateSteps(sum(s.prefill_tok_s for s in prompt), sum(s.step_s for s in decode) / len(decode))
    return EngineShape(steps, 1.0, budget * len(prompt), seats, contended_chunk * len(prompt))
