"""What the engine's steps did, counted: tokens in and out, time busy on prompt work and on decoding,
the last step's timings, an optional log of every step, and the speed tracker that admission predicts
from. EngineCore.step schedules, runs and updates; it hands each step to the meter once, here."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.runner import StepTimings
from tandem.engine.speed import SpeedTracker
from tandem.engine.step import SchedulerOutput


@dataclass
class LoggedStep:
    """One step as scheduled and timed: what a simulator replays and a cost model is fitted to."""

    scheduled: list[tuple[str, int, int, bool]]  # (request id, new tokens, tokens computed before, sampled)
    seconds: float


@dataclass
class StepStats:
    num_scheduled_tokens: int = 0
    num_requests: int = 0
    schedule_s: float = 0.0
    update_s: float = 0.0
    runner: StepTimings = field(default_factory=StepTimings)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.update_s + self.runner.prepare_s + self.runner.forward_s + self.runner.sample_s


class StepMeter:
    def __init__(self) -> None:
        self.last_step = StepStats()
        self.step_log: list[LoggedStep] | None = None  # a list: every step is recorded into it
        self.num_prompt_tokens = 0  # of the requests added
        self.num_generation_tokens = 0
        # Time of steps with prompt chunks and their prompt tokens: what admission control divides.
        self.prompt_busy_s = 0.0
        self.num_computed_prompt_tokens = 0
        # Time and count of steps that decoded: the time between two tokens of a running request.
        self.decode_busy_s = 0.0
        self.num_decode_steps = 0
        self.speed: SpeedTracker | None = None  # profiled when serving (profile_speed): admission predicts from it
        # The last step's (decode rows, prompt tokens, start) while steps follow each other.
        self._previous: tuple[int, int, float] | None = None

    def idle(self, schedule_s: float) -> None:
        """A step with nothing scheduled."""
        self.last_step = StepStats(schedule_s=schedule_s)
        self._previous = None

    def scheduled(self, sched: SchedulerOutput) -> list[tuple[str, int, int, bool]] | None:
        """The step as scheduled, for the log (None when nobody logs): taken before the update moves
        the requests' counts on."""
        if self.step_log is None:
            return None
        return [(s.request.request_id, s.num_new_tokens, s.request.num_computed_tokens,
                 s.request.num_computed_tokens + s.num_new_tokens >= s.request.num_tokens) for s in sched.scheduled]

    def record(self, sched: SchedulerOutput, logged: list[tuple[str, int, int, bool]] | None, prompt_tokens: int,
               generated: int, schedule_s: float, update_s: float, timings: StepTimings, step_s: float,
               started: float) -> None:
        """A step that ran (from `started`, perf_counter): prompt_tokens of its tokens were prompt work, and
        it gave generated tokens."""
        self.num_generation_tokens += generated
        self.last_step = StepStats(sched.total_num_tokens, len(sched.scheduled), schedule_s, update_s, timings)
        if logged is not None and self.step_log is not None:
            self.step_log.append(LoggedStep(logged, step_s))
        if prompt_tokens:
            self.prompt_busy_s += step_s
            self.num_computed_prompt_tokens += prompt_tokens
        if prompt_tokens < sched.total_num_tokens:
            self.decode_busy_s += step_s
            self.num_decode_steps += 1
        if self.speed is not None:
            # The speed tracker learns the time from a step's start to the next one's while steps follow
            # each other: what a stream waits between tokens, the core loop's own work between steps
            # (outputs sent, requests taken in, speculation) and other processes on the cores included.
            # Timing the step alone predicted decode 11% fast under a 10x load's API process.
            if self._previous is not None:
                rows, tokens, start = self._previous
                self.speed.observe(rows, tokens, started - start)
            self._previous = (sched.total_num_tokens - prompt_tokens, prompt_tokens, started)
