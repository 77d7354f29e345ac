"""The last few minutes of serving, in fixed time buckets, for the dashboard: per bucket the
TTFT/TPOT/ITL percentiles of what clients received, finished and good requests (both SLOs met),
output tokens, and the engine's gauges. Prometheus histograms answer the same questions over a
scrape interval; this answers them with no Prometheus at all.

Fed from the API layer's own clock (ServerMetrics), so the latencies are the client's. A closed
bucket's summary is computed once; a poll only summarizes the open one."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from tandem.slo import Slo

BUCKET_S = 5.0
WINDOW_S = 300.0


@dataclass
class _Bucket:
    start: float  # wall-clock seconds (the page plots against real time)
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)  # arrival to first scheduled: TTFT's wait, not its work
    finished: int = 0
    good: int = 0
    failed: int = 0
    output_tokens: int = 0
    gauges: dict[str, float] = field(default_factory=dict)  # last seen in the bucket
    summary: dict | None = None  # set once the bucket is closed


def _pcts(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None}
    p50, p99 = np.percentile(np.asarray(values) * 1000.0, [50, 99])
    return {"p50": round(float(p50), 3), "p99": round(float(p99), 3)}


def _summary(b: _Bucket, width_s: float) -> dict:
    return {"t": b.start, "ttft_ms": _pcts(b.ttft), "tpot_ms": _pcts(b.tpot), "itl_ms": _pcts(b.itl),
            "queue_ms": _pcts(b.queue),
            "finished": b.finished, "good": b.good, "failed": b.failed,
            "output_tok_s": b.output_tokens / width_s, "goodput_rps": b.good / width_s, **b.gauges}


class LiveStats:
    def __init__(self, slo: Slo | None = None, bucket_s: float = BUCKET_S, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.slo = slo  # None: every finished request counts as good
        self.bucket_s = bucket_s
        self.window_s = window_s
        self.buckets: deque[_Bucket] = deque()  # oldest first; idle stretches leave no buckets
        self.clock = clock

    def _current(self) -> _Bucket:
        now = self.clock()
        start = now - now % self.bucket_s
        if not self.buckets or self.buckets[-1].start < start:
            self.buckets.append(_Bucket(start))
            while self.buckets[0].start <= start - self.window_s:
                self.buckets.popleft()
        return self.buckets[-1]

    def token_gap(self, seconds: float) -> None:
        self._current().itl.append(seconds)

    def tokens(self, n: int) -> None:
        self._current().output_tokens += n

    def finished(self, ttft_s: float | None, tpot_s: float | None, ok: bool, queue_s: float | None = None) -> None:
        b = self._current()
        if not ok:
            b.failed += 1
            return
        b.finished += 1
        if queue_s is not None:
            b.queue.append(queue_s)
        if ttft_s is not None:
            b.ttft.append(ttft_s)
        if tpot_s is not None:
            b.tpot.append(tpot_s)
        b.good += self.slo is None or self.slo.met(ttft_s, tpot_s)

    def gauges(self, **values: float) -> None:
        self._current().gauges.update(values)

    def series(self) -> list[dict]:
        """One summary per bucket, oldest first; the last bucket is still filling."""
        self._current()
        out = []
        for b in list(self.buckets)[:-1]:
            if b.summary is None:
                b.summary = _summary(b, self.bucket_s)
            out.append(b.summary)
        last = self.buckets[-1]
        out.append(_summary(last, max(self.clock() - last.start, 1e-3)))
        return out

    def window(self, seconds: float) -> dict:
        """The latency percentiles and rates over the last `seconds` (whole buckets)."""
        self._current()
        now = self.clock()
        recent = [b for b in self.buckets if b.start + self.bucket_s > now - seconds]
        span = max(min(seconds, now - recent[0].start), 1e-3) if recent else seconds
        finished = sum(b.finished for b in recent)
        good = sum(b.good for b in recent)
        return {"seconds": round(span, 3),
                "ttft_ms": _pcts([v for b in recent for v in b.ttft]),
                "tpot_ms": _pcts([v for b in recent for v in b.tpot]),
                "itl_ms": _pcts([v for b in recent for v in b.itl]),
                "queue_ms": _pcts([v for b in recent for v in b.queue]),
                "finished": finished, "good": good, "failed": sum(b.failed for b in recent),
                "request_rps": finished / span, "goodput_rps": good / span,
                "output_tok_s": sum(b.output_tokens for b in recent) / span,
                "slo_attainment": good / finished if finished else None}
