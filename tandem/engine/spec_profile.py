"""The step cost the speculation policy weighs drafts against: forward passes of n tokens, timed on
this machine and this model at start-up (with the engine's own kernels, threads and sampler)."""

from __future__ import annotations

import time

import numpy as np

from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.step import ScheduledRequest, SchedulerOutput
from tandem.sampling_params import SamplingParams
from tandem.speculative.policy import StepCost

MAX_PROFILED_TOKENS = 256  # past this a step's cost is linear in its tokens: extrapolated


def profiled_counts(num_speculative_tokens: int, limit: int) -> list[int]:
    """Every count a single stream's verification can have (the kernels' tiles make small counts
    irregular), then a geometric ladder for batches."""
    small = list(range(1, min(num_speculative_tokens + 1, 16) + 1))
    ladder = [24, 32, 48, 64, 96, 128, 192, 256]
    return [n for n in dict.fromkeys(small + ladder) if n <= min(limit, MAX_PROFILED_TOKENS)]


def profile_step_cost(runner: ModelRunner, counts: list[int], repeats: int = 2) -> StepCost:
    """Time one forward pass (and its sampling) per count, best of `repeats`, on a throwaway request
    whose KV goes to the pool's first blocks: nothing has been cached there yet at start-up, and any
    request writes its blocks before it reads them."""
    seconds = []
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for n in counts:
        request = Request("spec-profile", [0] * n, params)
        item = ScheduledRequest(request, n, list(range(-(-n // runner.block_size))))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.execute(SchedulerOutput([item]))
            best = min(best, time.perf_counter() - t0)
        seconds.append(best)
    runner.forget(["spec-profile"])
    # As measured, not smoothed: the kernels' row tiles make 4 tokens cost less than 3 on some CPUs.
    return StepCost(np.asarray(counts, dtype=np.float64), np.asarray(seconds))
