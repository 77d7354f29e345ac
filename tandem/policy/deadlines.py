"""Admission by predicted deadline misses: admit a request only if it is predicted to meet its TTFT
and TPOT SLOs without making a request already admitted miss one it would have met.

The prediction is the scheduler's own arithmetic over the engine's measured step times
(engine/speed.py: a start-up profile times a live factor; a cluster's router: its workers' measured
rates as one engine, latency.py fleet_shape). Each step decodes every running sequence
once and fills the rest of the token budget with prompt chunks in arrival order; so
  - prompt work drains at (budget - decoding sequences) tokens per step, each step as long as
    `step_s(decoding, chunk)`; while the waiting requests drain they join the decode batch (counted
    at half of them on average);
  - a new request's first token comes after the prompt work the scheduler puts ahead of it (its
    tenant's fair share of the queue) and its own prompt, plus half the step in flight, plus the
    wait for a sequence slot when all are taken (the soonest-finishing streams' tokens left);
  - its prompt is a stall for every sequence that decodes while it is computed: each of them spends
    min(its tokens left, the drain's steps) steps in full-budget steps and the rest in decode steps
    of the bigger batch. A stream's predicted TPOT is (its time since its first token + that
    future) over its token gaps; the new request's own is a decode step of the batch it joins
    (requests arriving later are checked against it in turn).

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
    """Seconds of one step: an engine's start-up profile (engine/speed.py StepSpeed), or a cluster's
    workers' measured rates (latency.py RateSteps)."""

    def step_s(self, decode_rows: float, prompt_tokens: float) -> float: ...


@dataclass(frozen=True)
class EngineShape:
    speed: StepModel
    factor: float  # the live correction (CoreStats.speed_factor)
    budget: int  # max_num_batched_tokens
    seats: int  # max_num_seqs
    # A tenant's prompt tokens a step while another tenant has requests in flight (0: its share only).
    contended_chunk: int = 0

    def step(self, decode_rows: float, prompt_tokens: float) -> float:
        return self.speed.step_s(decode_rows, prompt_tokens) * self.factor


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


def predict_ttft(engine: EngineShape, flights: Flights, num_seqs: int, prompt_tokens: int, ahead_tokens: int,
                 contended: bool = False) -> float:
    """Half the step in flight, a seat, the prompt work ahead and its own prompt. contended: another
    tenant has requests in flight, so this tenant's prompt work drains at most engine.contended_chunk
    tokens a step (the scheduler's cap; the rest of a step is the others')."""
    waiting = flights.prompt_tokens > 0
    decoding = (~waiting) & (flights.tokens_left > 0)
    d0 = float(flights.num_seqs[decoding].sum())
    queued = float(flights.prompt_tokens[waiting].sum())
    mid = min(d0 + float(flights.num_seqs[waiting].sum()) / 2, engine.seats)
    chunk = max(engine.budget - mid, MIN_CHUNK)
    work = min(ahead_tokens, queued) + prompt_tokens
    own = min(chunk, engine.contended_chunk) if contended and engine.contended_chunk else chunk
    # A step takes the whole chunk (the other tenants' share too) but this tenant's work moves by `own`.
    drain = engine.step(mid, work) if work <= own else work / own * engine.step(mid, chunk)
    in_flight_step = engine.step(d0, min(queued, chunk)) / 2 if d0 or queued else 0.0
    wait = seat_wait(engine, flights, num_seqs, chunk, engine.step(mid, chunk))
    # A seat frees after the prompts ahead are computed: its own prompt follows the later of the two.
    ahead_s = drain - (engine.step(mid, prompt_tokens) if prompt_tokens <= own else
                       prompt_tokens / own * engine.step(mid, chunk))
    return in_flight_step + max(wait, ahead_s) + (drain - ahead_s)


def timeouts_missed(engine: EngineShape, flights: Flights, num_seqs: int, prompt_tokens: int,
                    tpot_s: float) -> int:
    """Requests in flight predicted to finish within their timeout now and past it with a new request
    of num_seqs sequences and prompt_tokens admitted: its rows make every decode step longer and its
    prompt stalls them once. tpot_s: the time between tokens now (the larger of a decode step of
    everything in flight and what streams measured). Each request's finish: its prompt's turn in the
    queue (arrival order, the step's prompt chunk a full step), then its tokens left at tpot_s."""
    if flights.time_left is None or not len(flights.num_seqs) or not np.isfinite(flights.time_left).any():
        return 0
    rows = min(float(flights.num_seqs.sum()), engine.seats)
    grown = engine.step(min(rows + num_seqs, engine.seats), 0) / max(engine.step(rows, 0), 1e-9)
    stall = max(engine.step(rows, prompt_tokens) - engine.step(rows, 0), 0.0)
    waiting = flights.prompt_tokens > 0
    chunk = max(engine.budget - rows, MIN_CHUNK)
    starts = np.where(waiting, np.cumsum(flights.prompt_tokens) / chunk * engine.step(rows, chunk), 0.0)
    now = starts + flights.tokens_left * tpot_s
    later = starts + flights.tokens_left * tpot_s * max(grown, 1.0) + stall
    return int(np.sum((now <= flights.time_left) & (later > flights.time_left)))


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
