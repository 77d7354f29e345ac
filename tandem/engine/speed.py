"""How long this engine's steps take: measured at start-up, kept true as it runs.

Admission control predicts deadlines from it (policy/deadlines.py): when a new request's first token
would come, and what its prompt would add to the time between tokens of the requests decoding. A
step is a batch of decode rows (each reading its context) and prompt tokens; its time is the decode
rows' time plus the prompt tokens' time beyond the fixed cost of any forward pass (weights read once,
dispatch). Both curves are timed once at start-up with the engine's own kernels and threads
(spec_profile.py profile_speed); after that every step's measured time against the prediction
moves the curve of its larger part at its size (SpeedTracker), so a machine that gets slower
(another process on the cores, longer contexts than profiled) is seen within a few steps.
Plain data and arithmetic: the server's process reads it without the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FACTOR_ALPHA = 0.05  # weight of one step in the live correction: ~20 steps to follow a change
FACTOR_RANGE = (0.02, 50.0)  # a profile taken while another process held the cores can be 10-50x off


def _interp(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """Linear between the measured points, and past the last along its last segment."""
    if x <= xs[-1] or len(xs) < 2:
        return float(np.interp(x, xs, ys))
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    return ys[-1] + slope * (x - xs[-1])


@dataclass(frozen=True)
class StepSpeed:
    """Seconds of a step, as profiled: forward passes of n prompt tokens, and of b decode rows."""

    prompt_tokens: tuple[int, ...]
    prompt_s: tuple[float, ...]
    decode_rows: tuple[int, ...]
    decode_s: tuple[float, ...]

    def parts(self, decode_rows: float, prompt_tokens: float) -> tuple[float, float]:
        """One step of decode_rows decodes and prompt_tokens prompt tokens (before the live factors), as
        (the decode rows' time with the pass's fixed cost, the prompt tokens' time beyond it); a pass
        with no decode rows is all prompt time."""
        if decode_rows <= 0:
            return 0.0, _interp(self.prompt_tokens, self.prompt_s, max(prompt_tokens, 1))
        t = _interp(self.decode_rows, self.decode_s, decode_rows)
        if prompt_tokens <= 0:
            return t, 0.0
        return t, max(_interp(self.prompt_tokens, self.prompt_s, prompt_tokens) - self.prompt_s[0], 0.0)

    def step_s(self, decode_rows: float, prompt_tokens: float) -> float:
        return sum(self.parts(decode_rows, prompt_tokens))

    def describe(self) -> str:
        p = ", ".join(f"{n}: {s * 1e3:.0f}" for n, s in zip(self.prompt_tokens, self.prompt_s, strict=True))
        d = ", ".join(f"{n}: {s * 1e3:.0f}" for n, s in zip(self.decode_rows, self.decode_s, strict=True))
        return f"prompt tokens -> ms {{{p}}}; decode rows -> ms {{{d}}}"


def _moved(xs: tuple[int, ...], ys: list[float], base: tuple[float, ...], x: float, ratio: float) -> None:
    """Moves the curve's value at x by `ratio` (a step's measured time over the predicted), FACTOR_ALPHA
    of the way, through the two measured points around x in proportion to their nearness (the last one
    alone past the end, the first one before it), each kept within FACTOR_RANGE of the profile's."""
    ratio = min(max(ratio, FACTOR_RANGE[0]), FACTOR_RANGE[1])
    i = int(np.searchsorted(xs, x, side="right")) - 1
    if i < 0 or i >= len(xs) - 1:
        points = [(max(min(i, len(xs) - 1), 0), 1.0)]
    else:
        w = (x - xs[i]) / (xs[i + 1] - xs[i])
        points = [(i, 1.0 - w), (i + 1, w)]
    for j, weight in points:
        moved = ys[j] * (1.0 + FACTOR_ALPHA * weight * (ratio - 1.0))
        ys[j] = min(max(moved, base[j] * FACTOR_RANGE[0]), base[j] * FACTOR_RANGE[1])


class SpeedTracker:
    """The profile, kept true as the engine runs: each step's measured time against the prediction moves
    the curve of its larger part (decode rows, or prompt tokens) at that step's size, the other part
    taken as predicted. Per size, not one factor for all: a profile taken while the API process
    started on the same cores came out 1.5x slow for one decode row and about right for 32, and one
    factor fitted to the small steps of a light load then predicted a 40-row decode step 1.5x fast,
    so a burst admitted to the edge of its timeouts ran past them (benchmarks/hostile_traffic.py)."""

    def __init__(self, speed: StepSpeed) -> None:
        self.profile = speed
        self._decode = list(speed.decode_s)
        self._prompt = list(speed.prompt_s)

    @property
    def speed(self) -> StepSpeed:
        """The step times as they are now."""
        p = self.profile
        return StepSpeed(p.prompt_tokens, tuple(self._prompt), p.decode_rows, tuple(self._decode))

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        now = self.speed
        decode, prompt = now.parts(decode_rows, prompt_tokens)
        if seconds <= 0 or decode + prompt <= 0:
            return
        p = self.profile
        if prompt > decode:
            # The prompt curve's value at this size, with the measured prompt part in place of the predicted.
            at = _interp(p.prompt_tokens, tuple(self._prompt), max(prompt_tokens, 1))
            measured = at - prompt + max(seconds - decode, 0.0)
            _moved(p.prompt_tokens, self._prompt, p.prompt_s, max(prompt_tokens, 1), measured / at)
        else:
            _moved(p.decode_rows, self._decode, p.decode_s, decode_rows, max(seconds - prompt, 0.0) / decode)
