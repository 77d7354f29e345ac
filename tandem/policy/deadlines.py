"""Admission by predicted deadline misses: admit a request only if it is predicted to meet its TTFT
and TPOT SLOs without making a request already admitted miss one it would have met.

The prediction is the scheduler's own arithmetic over the engine's measured step times
(engine/speed.py: a start-up profile kept true by every step's measured time; a cluster's
router: its workers' measured rates as one engine, latency.py fleet_shape). Each step decodes every
running sequence once and fills the rest of the token budget with prompt chunks in arrival order
(while tenants contend, each takes at most contended_chunk tokens of it: prompt_per_step); so
  - prompt work drains at prompt_per_step tokens a step, each step as long as
    `step(decoding, those tokens)`; while the waiting requests drain they join the decode batch
    (counted at half of them on average);
  - a new request's first token comes after the prompt work the scheduler puts ahead of it (its
    tenant's fair share of the queue) and its own prompt at its tenant's share of a step, plus half
    the step in flight, plus the wait for a sequence slot when all are taken (the soonest-finishing
    streams' tokens left);
  - its prompt is a stall for every sequence that decodes while it is computed: each of them spends
    min(its tokens left, the drain's steps) steps in full steps and the rest in decode steps of the
    bigger batch (finish_times: when each request in flight has its last token; the queue mode
    refuses an admission that pushes one past its timeout). A stream's predicted TPOT is (its time
    since its first token + that future) over its token gaps; the new request's own is a decode step
    of the batch it joins (requests arriving later are checked against it in turn).

Light load predicts an idle server's TTFT and TPOT, far inside any SLO: nothing is refused then.
An SLO the engine cannot meet even idle (a slow machine, another process on the cores, a long
prompt) is stretched to STRETCH times what the request would see on an idle server, so that such a
server still serves concurrently instead of one request at a time (`deadlines`).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from tandem.slo import Slo

MIN_CHUNK = 16  # prompt tokens a step takes even with a full decode batch (the scheduler's floor)
STRETCH = 2.0
# A request in flight predicted past its timeout by more than this, whatever is admitted, is not
# protected from new admissions (its timeout ends it); one less late still is.
LOST_CAUSE = 1.5


@dataclass
class Flights:
    """The sequences in flight as the frontend counts them, in arrival order (arrays, one entry a
    request; n samples are num_seqs sequences with the same progress)."""

    num_seqs: np.ndarray  # int
    prompt_tokens: np.ndarray  # int: its prompt until its first token, then 0
    tokens_left: np.ndarray  # int: of its longest sample
    tokens_done: np.ndarray  # int: tokens streamed so far
    decode_s: np.ndarray  # float: seconds since its first token
    time_left: np.ndarray | None = None  # float: seconds until its timeout (inf: none); None: none known

    @classmethod
    def of(cls, rows: list[tuple[float, ...]]) -> Flights:
        """Rows of (num_seqs, prompt_tokens, tokens_left, tokens_done, decode_s[, time_left])."""
        a = np.asarray(rows, dtype=np.float64)
        a = a.reshape(-1, a.shape[1] if a.ndim == 2 else 5)
        return cls(a[:, 0], a[:, 1], a[:, 2], a[:, 3], a[:, 4], a[:, 5] if a.shape[1] > 5 else None)


class StepModel(Protocol):
    """Seconds of one step, as (its decode rows' part, its prompt tokens' part): an engine's start-up
    profile (engine/speed.py StepSpeed), or a cluster's workers' measured rates (latency.py RateSteps)."""

    def parts(self, decode_rows: float, prompt_tokens: float) -> tuple[float, float]: ...


@dataclass(frozen=True)
class EngineShape:
    speed: StepModel
    factor: float  # a correction on every step (1: the step model is live already)
    budget: int  # max_num_batched_tokens
    seats: int  # max_num_seqs
    # A tenant's prompt tokens a step while another tenant has requests in flight (0: its share only).
    contended_chunk: int = 0

    def step(self, decode_rows: float, prompt_tokens: float) -> float:
        return sum(self.speed.parts(decode_rows, prompt_tokens)) * self.factor


@dataclass
class Prediction:
    ttft_s: float
    tpot_s: float  # the new request's own
    harmed: int  # requests in flight that meet their TPOT deadline without it and miss it with it
    worst_tpot_s: float  # the worst TPOT in flight with it admitted (those that would meet it)
    ttft_deadline_s: float  # the SLO, or STRETCH x its idle TTFT if that is longer
    tpot_deadline_s: float


def deadlines(engine: EngineShape, slo: Slo, prompt_tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) deadlines of a request: the SLOs, stretched where even an idle server misses them."""
    return (max(slo.ttft_s, STRETCH * engine.step(0, prompt_tokens)),
            max(slo.tpot_s, STRETCH * engine.step(1, 0)))


def seat_wait(engine: EngineShape, flights: Flights, num_seqs: int, chunk: float, full_step_s: float) -> float:
    """When the new request's sequences have seats (max_num_seqs), if they must wait for them: every
    sequence in flight takes a seat in arrival order as one frees (a decoding one holds its seat for
    its tokens left, a waiting one from when its seat frees and its prompt is computed, the prompt
    queue draining chunk tokens a full step, for its tokens left); the new request's last sequence
    takes the seat that frees after those. inf for more sequences than seats."""
    total = int(flights.num_seqs.sum()) + num_seqs
    if total <= engine.seats:
        return 0.0
    if num_seqs > engine.seats:
        return float("inf")
    waiting = flights.prompt_tokens > 0
    decoding = (~waiting) & (flights.tokens_left > 0)
    gap = engine.step(min(total, engine.seats), 0)
    free = list(np.repeat(flights.tokens_left[decoding], flights.num_seqs[decoding].astype(np.int64)) * gap)
    free += [0.0] * max(engine.seats - len(free), 0)
    heapq.heapify(free)
    ready = np.cumsum(flights.prompt_tokens[waiting]) / chunk * full_step_s  # prompts computed, in order
    # A prompt computed when its seat frees lengthens the step it shares, so it delays every seat
    # still held: an offset on all the times in the heap (stored less the offset).
    offset = 0.0
    for n, prompt, left, at in zip(flights.num_seqs[waiting].astype(np.int64), flights.prompt_tokens[waiting],
                                   flights.tokens_left[waiting], ready, strict=True):
        cost = engine.step(engine.seats, float(prompt)) - engine.step(engine.seats, 0)
        for _ in range(int(n)):
            start = max(heapq.heappop(free) + offset, float(at))
            heapq.heappush(free, start + float(left) * gap - offset)
        offset += cost
    return max(heapq.heappop(free) + offset for _ in range(num_seqs))


def prompt_per_step(engine: EngineShape, decode_rows: float, contended: bool = False, sharing: int = 1) -> float:
    """Prompt tokens a step computes while prompts wait: the token budget less the decode rows (at least
    MIN_CHUNK). contended: another tenant has requests in flight, so each of the `sharing` tenants with
    prompts waiting takes at most engine.contended_chunk tokens a step (the scheduler's cap,
    engine/tenant_shares.py): two tenants' prompts share a step of 2 x 128 tokens, not the whole budget."""
    chunk = max(engine.budget - decode_rows, MIN_CHUNK)
    if contended and engine.contended_chunk:
        return min(chunk, engine.contended_chunk * max(sharing, 1))
    return chunk


def predict_ttft(engine: EngineShape, flights: Flights, num_seqs: int, prompt_tokens: int, ahead_tokens: int,
                 contended: bool = False, sharing: int = 1) -> float:
    """Half the step in flight, a seat, the prompt work ahead (ahead_tokens, of all tenants) at
    prompt_per_step tokens a step, and its own prompt at its tenant's share of a step (contended,
    sharing: as there; the other tenants' shares fill the same steps)."""
    waiting = flights.prompt_tokens > 0
    decoding = (~waiting) & (flights.tokens_left > 0)
    d0 = float(flights.num_seqs[decoding].sum())
    queued = float(flights.prompt_tokens[waiting].sum())
    mid = min(d0 + float(flights.num_seqs[waiting].sum()) / 2, engine.seats)
    per_step = prompt_per_step(engine, mid, contended, sharing)
    own = per_step if not (contended and engine.contended_chunk) else min(per_step, engine.contended_chunk)
    full = engine.step(mid, per_step)
    ahead = min(ahead_tokens, queued)
    ahead_s = ahead / per_step * full if ahead > per_step else engine.step(mid, ahead) if ahead > 0 else 0.0
    own_s = (prompt_tokens / own * full if prompt_tokens > own else
             engine.step(mid, min(per_step, prompt_tokens + own * (max(sharing, 1) - 1))))
    in_flight_step = engine.step(d0, min(queued, per_step)) / 2 if d0 or queued else 0.0
    wait = seat_wait(engine, flights, num_seqs, per_step, full)
    # A seat frees after the prompts ahead are computed: its own prompt follows the later of the two.
    return in_flight_step + max(wait, ahead_s) + own_s


def finish_times(engine: EngineShape, flights: Flights, per_step: float) -> np.ndarray:
    """Seconds until each request in flight has its last token. The waiting prompts are computed in
    arrival order, per_step tokens a step, in steps that also decode every running sequence; then
    the steps decode alone. So a request's first token comes after the prompts up to its own, and
    each of its tokens after that takes a full step while prompts behind it remain, a decode step
    once they are done."""
    rows = min(float(flights.num_seqs.sum()), engine.seats)
    full, decode = engine.step(rows, per_step), engine.step(rows, 0)
    waiting = flights.prompt_tokens > 0
    first = np.where(waiting, np.cumsum(flights.prompt_tokens) / per_step, 0.0)  # full steps to its first token
    drain = float(flights.prompt_tokens.sum()) / per_step
    left = np.maximum(flights.tokens_left - waiting, 0)
    in_full = np.minimum(left, np.maximum(drain - first, 0.0))
    return first * full + in_full * full + (left - in_full) * decode


def with_request(flights: Flights, num_seqs: int, prompt_tokens: int, max_tokens: int) -> Flights:
    """The flights with a new request queued last."""
    def grow(a: np.ndarray, value: float) -> np.ndarray:
        return np.append(a, value)

    return Flights(grow(flights.num_seqs, num_seqs), grow(flights.prompt_tokens, max(prompt_tokens, 1)),
                   grow(flights.tokens_left, max_tokens), grow(flights.tokens_done, 0), grow(flights.decode_s, 0.0),
                   grow(flights.time_left, np.inf) if flights.time_left is not None else None)


def timeouts_missed(engine: EngineShape, flights: Flights, num_seqs: int, prompt_tokens: int, per_step: float,
                    margin: float = 1.0) -> int:
    """Requests in flight predicted past their timeout with a new request of num_seqs sequences and
    prompt_tokens admitted (finish_times, each time x margin): its rows make every step longer and its
    prompt adds full steps for everyone still decoding while it is computed. One predicted past it
    already counts too, unless by more than LOST_CAUSE: exempting every one already past let a burst
    admitted to the edge of its timeouts, then a little slower than predicted, take more and more
    arrivals while all of it timed out (benchmarks/hostile_traffic.py at 10x load)."""
    if flights.time_left is None or not len(flights.num_seqs) or not np.isfinite(flights.time_left).any():
        return 0
    now = finish_times(engine, flights, per_step) * margin
    later = finish_times(engine, with_request(flights, num_seqs, prompt_tokens, 1), per_step)[:-1] * margin
    return int(np.sum((now <= flights.time_left * LOST_CAUSE) & (later > flights.time_left)))


class Calibration:
    """Admitted requests' first tokens as they came against their predictions: the factor on the
    next TTFT predictions. It takes in what the step profile cannot see: the API process's own
    queue (parsing, tokenizing and refusing under a flood), the sockets between the processes."""

    ALPHA, RANGE = 0.1, (0.5, 5.0)

    def __init__(self) -> None:
        self.ttft = 1.0

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if predicted_s <= 0.01:  # an idle server's first token: noise, not a bias
            return
        ratio = min(max(actual_s / predicted_s, self.RANGE[0]), self.RANGE[1])
        self.ttft += self.ALPHA * (ratio - self.ttft)


def predict(engine: EngineShape, slo: Slo, flights: Flights, num_seqs: int, prompt_tokens: int,
            max_tokens: int, ahead_tokens: int) -> Prediction:
    """ahead_tokens: the waiting prompt work the scheduler runs before this request's."""
    ttft_deadline, tpot_deadline = deadlines(engine, slo, prompt_tokens)
    waiting = flights.prompt_tokens > 0
    decoding = (~waiting) & (flights.tokens_left > 0)
    d0 = float(flights.num_seqs[decoding].sum())
    w_seqs = float(flights.num_seqs[waiting].sum())
    queued = float(flights.prompt_tokens[waiting].sum())
    mid = min(d0 + w_seqs / 2, engine.seats)
    chunk = max(engine.budget - mid, MIN_CHUNK)
    full = engine.step(mid, chunk)

    ttft = predict_ttft(engine, flights, num_seqs, prompt_tokens, ahead_tokens)
    after = min(d0 + w_seqs + num_seqs, engine.seats)
    own_tpot = engine.step(after, 0) if max_tokens > 1 else 0.0

    # Everyone else's TPOT, without it and with it: steps spent in full steps while prompts drain.
    if not len(flights.num_seqs):
        return Prediction(ttft, own_tpot, 0, 0.0, ttft_deadline, tpot_deadline)
    starts = np.where(waiting, (np.cumsum(flights.prompt_tokens) / chunk), 0.0)  # step of each first token
    gaps = np.where(waiting, flights.tokens_left - 1, flights.tokens_done - 1 + flights.tokens_left)
    left = np.where(waiting, flights.tokens_left - 1, flights.tokens_left)

    def tpots(drain_steps: float, batch: float) -> np.ndarray:
        stalled = np.minimum(left, np.maximum(drain_steps - starts, 0.0))
        future = stalled * full + (left - stalled) * engine.step(batch, 0)
        return (flights.decode_s + future) / np.maximum(gaps, 1)

    judged = gaps >= 1  # one-token requests have no TPOT
    without = tpots(queued / chunk, min(d0 + w_seqs, engine.seats))
    with_it = tpots((queued + prompt_tokens) / chunk, after)
    harmed = int(np.sum(judged & (without <= tpot_deadline) & (with_it > tpot_deadline)))
    kept = judged & (without <= tpot_deadline)
    worst = float(with_it[kept].max()) if kept.any() else 0.0
    return Prediction(ttft, own_tpot, harmed, worst, ttft_deadline, tpot_deadline)
