"""When each session starts, in seconds after the benchmark's start."""

from __future__ import annotations

import math

import numpy as np

from tandem.bench.workloads import Session


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Start offsets of `n` requests arriving at `request_rate` per second on average.

    Gaps are gamma distributed with shape `burstiness` and mean 1 / rate: burstiness 1 is a Poisson
    process, below 1 is burstier, above 1 more regular. An infinite rate sends everything at once.
    The first request goes at 0.
    """
    if n <= 0:
        return []
    if request_rate <= 0:
        raise ValueError(f"request_rate must be positive, got {request_rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def session_offsets(sessions: list[Session], request_rate: float, burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """A trace's own timestamps when every session has one, otherwise the arrival process."""
    if sessions and all(s.timestamp is not None for s in sessions):
        return [float(s.timestamp) for s in sessions]  # type: ignore[arg-type]
    return arrival_offsets(len(sessions), request_rate, burstiness, seed)
