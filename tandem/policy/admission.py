"""Admission control: which requests the server takes, and which it refuses at once (429 with
Retry-After) because they could not be served anyway.

Three modes (`--admission`), one set of rules for the single server and a cluster's router:
  queue (the default) queues ordinary load as vLLM and llama-server do, and refuses a request only
      when it cannot start in time: its first token predicted later than its own `timeout` or
      `--max-queue-delay`, its last token (when it names max_tokens) past its `timeout`, or the
      waiting-request caps full. A burst past the engine's seats waits for seats instead of being
      refused;
  slo refuses what is predicted to miss the TTFT and TPOT SLOs, or to make a request in flight miss
      its TPOT SLO (deadlines.py), beside the seat and TTFT-budget rules below;
  off applies only the caps (waiting requests, per tenant).
The wait is predicted from the engine's measured step times (deadlines.py, with the calibration from
admitted requests' first tokens): a single server's start-up profile, or a cluster's workers' measured
rates as one engine (latency.py fleet_shape); before either exists, from the measured prompt throughput.
A request's last token, and those of the requests in flight with it admitted, are predicted from the
same steps (deadlines.finish_times) and must come FINISH_MARGIN inside the timeouts.
Prompt tokens the prefix cache holds are not counted as work (the caller passes uncached tokens).

Fairness: the scheduler shares prompt compute between tenants, so a request waits behind its own
tenant's queue times the tenants waiting, never more than the whole queue (Load.ahead_tokens): a
flood's backlog counts against the flooder, and another tenant's short request is admitted.
The slo mode's extra rules:
  - seats: requests in flight against max_num_seqs times seat_overcommit; with a TTFT budget, a
    request that would wait for a seat is admitted only if one frees up in time;
  - queued prompt tokens against a TTFT budget (--admission-ttft-budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tandem.policy.deadlines import EngineShape, Flights, predict, predict_ttft, prompt_per_step, timeouts_missed
from tandem.slo import Slo

ADMISSION_MODES = ("queue", "slo", "off")
# queue: a predicted last token must come this much inside a timeout (predicted finish x margin <=
# timeout). The step model predicted the decode of a burst admitted during a long prompt queue 10-20%
# fast on a 2-core Zen 3 (a batch size the live profile had not seen yet, longer contexts than
# profiled, the API process on the same cores): benchmarks/hostile_traffic.py at 10x load.
FINISH_MARGIN = 1.25


@dataclass
class AdmissionSettings:
    mode: str = "queue"  # one of ADMISSION_MODES
    max_waiting_requests: int = 512
    # queue: the longest a request may be predicted to wait for its first token.
    max_queue_delay_s: float = 120.0
    # slo: requests in flight per engine seat (max_num_seqs); above 1 lets some wait for a seat.
    seat_overcommit: float = 1.0
    # slo: seconds of queued prompt work (at the measured rate) a new request may wait behind; None: no limit.
    ttft_budget_s: float | None = None
    max_tenant_waiting_requests: int | None = None
    max_tenant_queued_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ADMISSION_MODES:
            raise ValueError(f"admission mode must be one of {', '.join(ADMISSION_MODES)}, got {self.mode!r}")

    @property
    def predicts(self) -> bool:
        """Whether the rules use the engine's step times (the server then profiles them at start-up)."""
        return self.mode != "off"

    def describe(self, slo: Slo, router: bool = False) -> str:
        """What admission does, for the start-up log (router: a cluster's, which predicts a lone worker from
        its step profile and several from their measured rates as one engine, policy/latency.py fleet_shape)."""
        if self.mode == "queue":
            how = ("waits predicted from a lone worker's step times, or the workers' measured rates, the "
                   "fleet as one engine" if router else "waits predicted from the engine's step times")
            return (f"queue (requests wait for the engine; 429 only for one that cannot start within its own "
                    f"timeout or {self.max_queue_delay_s:g} s (--max-queue-delay), or past "
                    f"{self.max_waiting_requests} waiting; {how}; --admission slo|off)")
        if self.mode == "slo":
            source = ("a lone worker's step times or the workers' measured rates" if router else
                      "the engine's step times")
            return (f"slo (429 unless a request is predicted to meet TTFT {slo.ttft_s * 1e3:.0f} ms and TPOT "
                    f"{slo.tpot_s * 1e3:.0f} ms without making another miss, from {source}; --slo-ttft-ms, "
                    f"--slo-tpot-ms)")
        return f"off (only the caps: {self.max_waiting_requests} waiting, per-tenant limits)"


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
    other_tenants_active: int = 0  # tenants other than the caller's with requests in flight (waiting or decoding)

    def seat_wait(self, over: int) -> float:
        """How long until `over` more sequences than the seats have one (0: none wait; inf: never)."""
        if over <= 0:
            return 0.0
        return self.seat_free_s[over - 1] if over <= len(self.seat_free_s) else math.inf

    @property
    def contention(self) -> tuple[bool, int]:
        """(whether another tenant has requests in flight, the tenants with prompts waiting once this
        tenant's new request waits too): how the scheduler caps a step's prompt tokens."""
        return self.other_tenants_active > 0, 1 + self.other_tenants_waiting

    def prompt_per_step(self, engine: EngineShape, decode_rows: float) -> float:
        """Prompt tokens a step computes with this tenant's new request waiting (deadlines.prompt_per_step)."""
        return prompt_per_step(engine, decode_rows, *self.contention)

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
    """What the predictions need beyond the load: the engine's speed and shape, the SLOs, and the
    call's longest output (max_tokens_given: whether the request named it, or it is the context's)."""

    engine: EngineShape | None  # None: nothing measured yet: predicted from the prompt rate
    slo: Slo
    max_tokens: int
    ttft_bias: float = 1.0  # admitted first tokens against their predictions (deadlines.Calibration)
    max_tokens_given: bool = True


def check_admission(settings: AdmissionSettings, seats: int, load: Load, num_requests: int, num_seqs: int,
                    prompt_tokens: int, tokens_per_s: float, timeout_s: float | None,
                    deadlines: Deadlines | None = None) -> Rejection | None:
    """None to admit, or why not and when to retry. A call may hold several prompts (num_requests),
    each sampled n times (num_seqs in all); prompt_tokens counts every prompt of the call that the
    prefix cache does not hold (0 before they are tokenized: the server checks once before
    tokenizing, so a refusal costs next to nothing, and once after). deadlines None, or its engine None
    (nothing measured yet): predicted from the prompt throughput alone."""
    retry = max(1, math.ceil(load.queued_tokens / max(tokens_per_s, 1.0)))
    if load.waiting + num_requests > settings.max_waiting_requests:
        return Rejection(f"too many requests are waiting ({load.waiting}, at most {settings.max_waiting_requests}); "
                         f"retry later", retry)
    if settings.max_tenant_waiting_requests is not None and \
            load.tenant_waiting + num_requests > settings.max_tenant_waiting_requests:
        return Rejection("too many of your requests are waiting; retry later", retry)
    if settings.max_tenant_queued_tokens is not None and \
            load.tenant_queued_tokens + prompt_tokens > settings.max_tenant_queued_tokens:
        return Rejection("too many of your prompt tokens are queued; retry later", retry)
    if settings.mode == "off" or not load.in_flight:  # an idle server: refusing could help nobody
        return None
    if settings.mode == "queue":
        return _check_queue(settings, seats, load, num_seqs, prompt_tokens, tokens_per_s, timeout_s, deadlines, retry)
    return _check_slo(settings, seats, load, num_seqs, prompt_tokens, tokens_per_s, timeout_s, deadlines, retry)


@dataclass(frozen=True)
class Wait:
    """A new request's predicted first token and time per output token (None: not predicted)."""

    ttft_s: float
    tpot_s: float | None


def predict_wait(seats: int, load: Load, num_seqs: int, prompt_tokens: int, tokens_per_s: float,
                 engine: EngineShape | None) -> Wait:
    """When the request's first token would come, before calibration: from the step profile where the
    engine has one (deadlines.predict_ttft), else the seat it waits for and the prompt work ahead of
    it and its own at the measured prompt rate."""
    if engine is not None and load.flights is not None:
        ttft = predict_ttft(engine, load.flights, num_seqs, prompt_tokens, load.ahead_tokens, *load.contention)
        return Wait(ttft, engine.step(min(load.in_flight + num_seqs, engine.seats), 0))
    seat_wait = load.seat_wait(load.in_flight + num_seqs - seats)
    return Wait(seat_wait + (load.ahead_tokens + prompt_tokens) / max(tokens_per_s, 1.0), None)


def _check_queue(settings: AdmissionSettings, seats: int, load: Load, num_seqs: int, prompt_tokens: int,
                 tokens_per_s: float, timeout_s: float | None, deadlines: Deadlines | None,
                 retry: int) -> Rejection | None:
    """Refuse only what cannot start in time: past the queue's bound, or past the request's own timeout
    (its last token too, when it names max_tokens and the step profile gives a time per token)."""
    wait = predict_wait(seats, load, num_seqs, prompt_tokens, tokens_per_s,
                        deadlines.engine if deadlines is not None else None)
    if deadlines is not None:
        wait = Wait(wait.ttft_s * deadlines.ttft_bias, wait.tpot_s)
    retry = max(retry, math.ceil(min(wait.ttft_s, 3600)) if math.isfinite(wait.ttft_s) else 3600)
    if wait.ttft_s > settings.max_queue_delay_s:
        return Rejection(f"its first token is predicted in {wait.ttft_s:.1f} s, past the queue's bound "
                         f"({settings.max_queue_delay_s:g} s); retry later", retry)
    if timeout_s is None:
        return None
    if wait.ttft_s > timeout_s:
        return Rejection(f"this request cannot start within its timeout ({timeout_s:g} s): its first token is "
                         f"predicted in {wait.ttft_s:.1f} s", retry)
    if deadlines is not None and deadlines.max_tokens_given and wait.tpot_s is not None:
        # It is queued last: the prompts ahead are computed by its first token, and then its tokens come
        # a decode step of everything in flight apart (later arrivals are checked against it in turn:
        # _check_harm).
        finish = (wait.ttft_s + max(deadlines.max_tokens - 1, 0) * wait.tpot_s) * FINISH_MARGIN
        if finish > timeout_s:
            return Rejection(f"this request cannot finish within its timeout ({timeout_s:g} s): its "
                             f"{deadlines.max_tokens} tokens are predicted to take {finish:.1f} s", retry)
    return _check_harm(load, num_seqs, prompt_tokens, deadlines, retry)


def _check_harm(load: Load, num_seqs: int, prompt_tokens: int, deadlines: Deadlines | None,
                retry: int) -> Rejection | None:
    """Requests decode in one batch, so those admitted together finish together: each admission must
    also leave the ones in flight within their timeouts, or a burst admitted at a light load's speed
    runs past them all at once (benchmarks/hostile_traffic.py at 10x load)."""
    engine = deadlines.engine if deadlines is not None else None
    if engine is None or load.flights is None:
        return None
    per_step = load.prompt_per_step(engine, min(load.in_flight, engine.seats))
    missed = timeouts_missed(engine, load.flights, num_seqs, prompt_tokens, per_step, FINISH_MARGIN)
    if missed:
        return Rejection(f"admitting it would make {missed} request(s) in flight miss their timeout; retry later",
                         retry)
    return None


def _check_slo(settings: AdmissionSettings, seats: int, load: Load, num_seqs: int, prompt_tokens: int,
               tokens_per_s: float, timeout_s: float | None, deadlines: Deadlines | None,
               retry: int) -> Rejection | None:
    # The wait before its first chunk: the prompt work ahead of it (its own prompt is its service time).
    ahead = load.ahead_tokens
    wait_s = ahead / max(tokens_per_s, 1.0)
    over = load.in_flight + num_seqs - seats  # sequences that would wait for a seat
    if load.in_flight + num_seqs > seats * settings.seat_overcommit:
        return Rejection(f"the engine is serving at capacity ({seats} concurrent sequences); retry later", retry)
    if over > 0 and settings.ttft_budget_s is not None:
        # With a TTFT budget, waiting for a seat is fine if one frees up in time.
        seat_wait = load.seat_wait(over)
        if seat_wait + wait_s > settings.ttft_budget_s:
            return Rejection(f"no sequence slot frees up within the TTFT budget ({settings.ttft_budget_s:.1f} s; "
                             f"{seats} concurrent sequences); retry later", max(retry, math.ceil(seat_wait)))
    if load.waiting and settings.ttft_budget_s is not None and wait_s > settings.ttft_budget_s:
        return Rejection(f"the queue would delay this request's first token by {wait_s:.1f} s "
                         f"(budget {settings.ttft_budget_s:.1f} s); retry later", retry)
    if load.waiting and timeout_s is not None and wait_s > timeout_s:
        return Rejection(f"this request cannot start within its timeout ({timeout_s:g} s)", retry)
    if deadlines is not None and deadlines.engine is not None and load.flights is not None:
        return _check_deadlines(deadlines, load, num_seqs, prompt_tokens, ahead, retry)
    return None


def _check_deadlines(d: Deadlines, load: Load, num_seqs: int, prompt_tokens: int, ahead: int,
                     retry: int) -> Rejection | None:
    assert load.flights is not None and d.engine is not None
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
