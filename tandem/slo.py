"""The latency SLOs a request is judged by: time to first token and time per output token after it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Both met (a request of one token has no TPOT to miss); a request with no first token failed."""
        return ttft_s is not None and ttft_s <= self.ttft_s and (tpot_s is None or tpot_s <= self.tpot_s)


# The defaults of `tandem serve --slo-ttft-ms/--slo-tpot-ms`: what admission predicts deadlines against
# when a server is built without them.
DEFAULT_SLO = Slo(2.0, 0.2)


# The latency histograms' buckets (seconds: TTFT, TPOT, ITL, a request's end to end), the same in the
# server's metrics and a cluster router's.
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
