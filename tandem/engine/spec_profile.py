"""Step costs timed on this machine and this model at start-up (with the engine's own kernels,
threads and sampler): forward passes of n tokens, which the speculation policy weighs drafts against,
and the prompt and decode curves admission control predicts deadlines from (engine/speed.py)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.speed import StepSpeed
from tandem.engine.step import ScheduledRequest, SchedulerOutput
from tandem.sampling_params import SamplingParams
from tandem.speculative.policy import StepCost

PROFILE_CONTEXT = 256  # tokens of context each profiled decode row reads (profile_speed)
# profile_speed stops climbing a ladder after a pass this long: the curve goes on along its last
# segment (prompt passes are near linear past a few hundred tokens), and a slow machine starts in
# seconds rather than spending ~15 of them timing 1,024-token passes twice.
PROFILE_PASS_LIMIT_S = 1.0
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


def _ladder(top: int, points: tuple[int, ...]) -> list[int]:
    return sorted({n for n in points if n < top} | {top})


@dataclass(frozen=True)
class SpeedPasses:
    """What profile_speed times: prompt passes up to `budget` tokens, and decode batches of up to `top`
    rows, each reading `context` tokens (the step-time cache keys a profile by it)."""

    budget: int
    top: int
    context: int


def speed_passes(max_num_batched_tokens: int, max_num_seqs: int, num_blocks: int, max_model_len: int,
                 block_size: int) -> SpeedPasses:
    """The passes for an engine's settings: decode batches only as large as the pool holds at
    PROFILE_CONTEXT."""
    budget = min(max_num_batched_tokens, max_model_len)
    context = min(PROFILE_CONTEXT, max_model_len - 1)
    per_row = -(-(context + 1) // block_size)
    return SpeedPasses(budget, max(1, min(max_num_seqs, budget, num_blocks // per_row)), context)


def profile_speed(runner: ModelRunner, passes: SpeedPasses) -> StepSpeed:
    """Time prompt passes up to the step budget and decode batches up to the passes' top, on throwaway
    requests whose KV goes to the pool's first blocks: nothing is cached there yet at start-up, and
    any request writes its blocks before it reads them."""
    budget, top, context = passes.budget, passes.top, passes.context
    profile_step_cost(runner, [1, 16])  # warm-up: first passes create kernels and touch pages
    tokens, prompt_s = _climb(_ladder(budget, (1, 16, 64, 256)),
                              lambda n: float(profile_step_cost(runner, [n], repeats=1).seconds[0]))
    per_row = -(-(context + 1) // runner.block_size)
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def decode_pass(b: int) -> float:
        items = []
        for i in range(b):
            # A generated token after `context` of prompt: a decode row as the runner sees one (with
            # batch-invariant kernels a prompt's last token is not one, and costs about 1.5x).
            r = Request(f"speed-profile-{i}", [0] * context, params)
            r.append_output_token(0)
            r.num_computed_tokens = context
            items.append(ScheduledRequest(r, 1, list(range(i * per_row, (i + 1) * per_row))))
        t0 = time.perf_counter()
        runner.execute(SchedulerOutput(items))
        seconds = time.perf_counter() - t0
        runner.forget([f"speed-profile-{i}" for i in range(b)])
        return seconds

    rows, decode_s = _climb(_ladder(top, (1, 8, 32, 128)), decode_pass)
    # Noise (another process on the cores) only ever adds time: a bigger pass never costs less
    # than a smaller one measured after it, so each point is at most the next one.
    return StepSpeed(tokens, _monotone(prompt_s), rows, _monotone(decode_s))


def _climb(ladder: list[int], time_pass: Callable[[int], float]) -> tuple[tuple[int, ...], list[float]]:
    """Each point's pass, best of two (one where the first took PROFILE_PASS_LIMIT_S), up the ladder
    until a pass takes that long."""
    points, seconds = [], []
    for n in ladder:
        t = time_pass(n)
        if t < PROFILE_PASS_LIMIT_S:
            t = min(t, time_pass(n))
        points.append(int(n))
        seconds.append(t)
        if t >= PROFILE_PASS_LIMIT_S and len(points) >= 2:
            break
    return tuple(points), seconds


def _monotone(seconds: Sequence[float]) -> tuple[float, ...]:
    out = [float(s) for s in seconds]
    for i in range(len(out) - 2, -1, -1):
        out[i] = min(out[i], out[i + 1])
    return tuple(out)
