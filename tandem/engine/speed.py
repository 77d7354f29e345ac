"""How long this engine's steps take: measured at start-up, kept true as it runs.

Admission control predicts deadlines from it (policy/deadlines.py): when a new request's first token
would come, and what its prompt would add to the time between tokens of the requests decoding. A
step is a batch of decode rows (each reading its context) and prompt tokens; its time is the decode
rows' time plus the prompt tokens' time beyond the fixed cost of any forward pass (weights read once,
dispatch). Both curves are timed once at start-up with the engine's own kernels and threads
(spec_profile.py profile_speed); after that every step's measured time against the prediction
moves one factor, so a machine that gets slower (another process on the cores, longer contexts
than profiled) is seen within a few steps.
Plain data and arithmetic: the server's process reads it without the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FACTOR_ALPHA = 0.05  # weight of one step in the correction factor: ~20 steps to follow a change
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

    def step_s(self, decode_rows: float, prompt_tokens: float) -> float:
        """One step of decode_rows decodes and prompt_tokens prompt tokens (before the live factor)."""
        if decode_rows <= 0:
            return _interp(self.prompt_tokens, self.prompt_s, max(prompt_tokens, 1))
        t = _interp(self.decode_rows, self.decode_s, decode_rows)
        if prompt_tokens > 0:  # the fixed cost of a pass is paid once
            t += max(_interp(self.prompt_tokens, self.prompt_s, prompt_tokens) - self.prompt_s[0], 0.0)
        return t

    def describe(self) -> str:
        p = ", ".join(f"{n}: {s * 1e3:.0f}" for n, s in zip(self.prompt_tokens, self.prompt_s, strict=True))
        d = ", ".join(f"{n}: {s * 1e3:.0f}" for n, s in zip(self.decode_rows, self.decode_s, strict=True))
        return f"prompt tokens -> ms {{{p}}}; decode rows -> ms {{{d}}}"


class SpeedTracker:
    """The profile and the factor by which steps now take longer (or shorter) than it says."""

    def __init__(self, speed: StepSpeed) -> None:
        self.speed = speed
        self.factor = 1.0

    def observe(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        predicted = self.speed.step_s(decode_rows, prompt_tokens)
        if predicted <= 0 or seconds <= 0:
            return
        ratio = min(max(seconds / predicted, FACTOR_RANGE[0]), FACTOR_RANGE[1])
        self.factor += FACTOR_ALPHA * (ratio - self.factor)
