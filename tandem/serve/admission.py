"""Admission control: accept only what the engine can serve within its latency budget.

A request the server accepts should start soon and stream steadily; one it cannot serve so is
better refused at once (429 with Retry-After) than queued until it times out. The rules look at what
the engine can actually do:
  - seats: requests in flight (accepted and unfinished, each of n samples counted) against the
    engine's max_num_seqs times seat_overcommit; with a TTFT budget, a request that would wait for a
    seat is admitted only if one frees up in time (each stream's tokens left times the measured
    time between tokens), so nothing admitted waits behind other requests' whole outputs;
  - queued prompt tokens against a TTFT budget: prompt tokens accepted but not yet started, over the
    engine's measured prompt throughput, is how long a new request waits for its first token. The
    scheduler shares that throughput between tenants, so a request waits behind its own tenant's
    queue times the tenants waiting (never more than the whole queue): a flood refuses the flooder;
  - per tenant: requests and prompt tokens queued, so one tenant cannot fill the queue for everyone;
  - the request's own timeout: a request that cannot start before it would time out is refused;
  - deadlines (on unless --admission off): a request is admitted only if it is predicted to meet
    the TTFT and TPOT SLOs without making a request in flight miss its TPOT SLO (deadlines.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.serve.deadlines import EngineShape, Flights, predict
from tandem.slo import Slo


@dataclass
class AdmissionSettings:
    max_waiting_requests: int = 512
    # Requests in flight per engine seat (max_num_seqs); above 1 lets some wait for a seat.
    seat_overcommit: float = 1.0
    # Seconds of queued prompt work (at the measured rate) a new request may wait behind; None: no limit.
    ttft_budget_s: float | None = 2.0
    max_tenant_waiting_requests: int | None = None
    max_tenant_queued_tokens: int | None = None
    # Admit only what is predicted to meet its SLOs without making others miss theirs (deadlines.py).
    predict: bool = True


@dataclass
class Load:
    """What is in flight now, as the server's frontend counts it."""

    in_flight: int  # engine requests accepted and not finished
    waiting: int  # requests without a first token
    queued_tokens: int  # their prompt tokens
    tenant_waiting: int
    tenant_queued_tokens: int
    other_tenants_waiting: int = 0  # tenants other than the caller's with requests waiting
    # When each sequence in flight will likely free its seat, soonest first (tokens left x token gap).
    seat_free_s: list[float] = field(default_factory=list)
    flights: Flights | None = None  # each request in flight, for the deadline prediction

    @property
    def ahead_tokens(self) -> int:
        """The prompt work the scheduler runs before a new request of this tenant: its own queue,
        shared with the other tenants waiting, never more than the whole queue."""
        return min(self.queued_tokens, self.tenant_queued_tokens * (1 + self.other_tenants_waiting))


@dataclass
class Rejection:
    message: str
    retry_after_s: int


class PromptRate:
    """Prompt tokens per second of engine busy time, smoothed; from the core's cumulative counters."""

    def __init__(self, initial: float = 2000.0, smoothing: float = 0.3) -> None:
        self.rate = initial
        self.smoothing = smoothing
        self._last: tuple[float, int] | None = None

    def observe(self, busy_s: float, computed_tokens: int) -> None:
        if self._last is not None:
            d_busy, d_tokens = busy_s - self._last[0], computed_tokens - self._last[1]
            if d_busy > 0.05 and d_tokens > 0:  # enough work since the last look to say something
                self.rate += self.smoothing * (d_tokens / d_busy - self.rate)
            elif d_busy <= 0.05:
                return  # keep accumulating from the same reference point
        self._last = (busy_s, computed_tokens)


@dataclass(frozen=True)
class Deadlines:
    """What the deadline rule needs beyond the load: the engine's speed and shape, the SLOs, and the
    call's longest output."""

    engine: EngineShape
    slo: Slo
    max_tokens: int
    ttft_bias: float = 1.0  # admitted first tokens against their predictions (deadlines.Calibration)


def check_admission(settings: AdmissionSettings, seats: int, load: Load, num_requests: int, num_seqs: int,
                    prompt_tokens: int, tokens_per_s: float, timeout_s: float | None,
                    deadlines: Deadlines | None = None) -> Rejection | None:
    """None to admit, or why not and when to retry. A call may hold several prompts (num_requests),
    each sampled n times (num_seqs in all); prompt_tokens counts every prompt of the call (0 before
    they are tokenized: the server checks once before tokenizing, so a refusal costs next to nothing,
    and once after). deadlines: None (off, or an engine that has not measured its speed) skips the
    prediction."""
    # The wait before its first chunk: the prompt work ahead of it (its own prompt is its service time).
    ahead = load.ahead_tokens
    wait_s = ahead / max(tokens_per_s, 1.0)
    retry = max(1, math.ceil(load.queued_tokens / max(tokens_per_s, 1.0)))
    if load.waiting + num_requests > settings.max_waiting_requests:
        return Rejection("too many requests are waiting; retry later", retry)
    over = load.in_flight + num_seqs - seats  # sequences that would wait for a seat
    if load.in_flight and load.in_flight + num_seqs > seats * settings.seat_overcommit:
        return Rejection(f"the engine is serving at capacity ({seats} concurrent sequences); retry later", retry)
    if load.in_flight and over > 0 and settings.ttft_budget_s is not None:
        # With a TTFT budget, waiting for a seat is fine if one frees up in time.
        seat_wait = load.seat_free_s[over - 1] if over <= len(load.seat_free_s) else math.inf
        if seat_wait + wait_s > settings.ttft_budget_s:
            return Rejection(f"no sequence slot frees up within the TTFT budget ({settings.ttft_budget_s:.1f} s; "
                             f"{seats} concurrent sequences); retry later", max(retry, math.ceil(seat_wait)))
    if settings.max_tenant_waiting_requests is not None and \
            load.tenant_waiting + num_requests > settings.max_tenant_waiting_requests:
        return Rejection("too many of your requests are waiting; retry later", retry)
    if settings.max_tenant_queued_tokens is not None and \
            load.tenant_queued_tokens + prompt_tokens > settings.max_tenant_queued_tokens:
        return Rejection("too many of your prompt tokens are queued; retry later", retry)
    if load.waiting and settings.ttft_budget_s is not None and wait_s > settings.ttft_budget_s:
        return Rejection(f"the queue would delay this request's first token by {wait_s:.1f} s "
                         f"(budget {settings.ttft_budget_s:.1f} s); retry later", retry)
    if load.waiting and timeout_s is not None and wait_s > timeout_s:
        return Rejection(f"this request cannot start within its timeout ({timeout_s:g} s)", retry)
    # An idle server admits whatever it predicts: refusing could help nobody.
    if settings.predict and deadlines is not None and load.flights is not None and load.in_flight:
        return _check_deadlines(deadlines, load, num_seqs, prompt_tokens, ahead, retry)
    return None


def _check_deadlines(d: Deadlines, load: Load, num_seqs: int, prompt_tokens: int, ahead: int,
                     retry: int) -> Rejection | None:
    assert load.flights is not None
    p = predict(d.engine, d.slo, load.flights, num_seqs, prompt_tokens, d.max_tokens, ahead)
    p.ttft_s *= d.ttft_bias
    if p.ttft_s > p.ttft_deadline_s:
        return Rejection(f"its first token is predicted in {p.ttft_s:.2f} s, past the TTFT deadline "
                         f"({p.ttft_deadline_s:.2f} s); retry later",
                         max(retry, math.ceil(min(p.ttft_s - p.ttft_deadline_s, 3600))))
    if p.tpot_s > p.tpot_deadline_s:
        return Rejection(f"its time per output token is predicted at {p.tpot_s * 1e3:.0f} ms, past the TPOT "
                         f"deadline ({p.tpot_deadline_s * 1e3:.0f} ms); retry later", retry)
    if p.harmed:
        return Rejection(f"its prompt would make {p.harmed} request(s) in flight miss the TPOT deadline "
                         f"({p.tpot_deadline_s * 1e3:.0f} ms); retry later", retry)
    return None
