"""Admission by predicted deadline misses (policy/deadlines.py, `--admission slo`), on a fixed step-time profile: the
times are the profile's, so every prediction below can be worked out by hand."""

from __future__ import annotations

import math

import pytest

from tandem.engine.spec_profile import _monotone
from tandem.engine.speed import SpeedTracker, StepSpeed
from tandem.policy.admission import AdmissionSettings, Deadlines, Load, check_admission
from tandem.policy.deadlines import EngineShape, Flights, predict
from tandem.slo import Slo

# 10 ms a pass plus 0.1 ms a prompt token; a decode row 0.5 ms beyond the pass.
SPEED = StepSpeed((1, 1001), (0.0101, 0.1101), (1, 101), (0.0105, 0.0605))
ENGINE = EngineShape(SPEED, 1.0, 256, 64)
SLO = Slo(1.0, 0.05)


def flights(*rows: tuple[int, int, int, int, float]) -> Flights:
    return Flights.of(list(rows))


def decoding(n: int, left: int = 50, done: int = 10, decode_s: float | None = None) -> list:
    gap = ENGINE.step(n, 0)
    return [(1, 0, left, done, (done - 1) * gap if decode_s is None else decode_s)] * n


def test_step_times_add_a_prompt_to_the_decode_rows_paying_the_pass_once() -> None:
    assert SPEED.step_s(0, 101) == pytest.approx(0.0201)
    assert SPEED.step_s(11, 0) == pytest.approx(0.0155)
    assert SPEED.step_s(11, 101) == pytest.approx(0.0155 + 0.0100)
    assert SPEED.step_s(201, 0) == pytest.approx(0.1105), "past the last point: along the last segment"


def test_an_idle_server_predicts_its_own_prompt_and_one_decode_step() -> None:
    p = predict(ENGINE, SLO, flights(), 1, 200, 32, 0)
    assert p.ttft_s == pytest.approx(SPEED.step_s(0, 200))
    assert p.tpot_s == pytest.approx(SPEED.step_s(1, 0))
    assert (p.harmed, p.worst_tpot_s) == (0, 0.0)
    assert predict(ENGINE, SLO, flights(), 1, 200, 1, 0).tpot_s == 0.0, "one token: no TPOT"


def test_the_first_token_waits_for_the_prompt_work_ahead_and_the_step_in_flight() -> None:
    queue = flights((1, 1000, 32, 0, 0.0), (1, 1000, 32, 0, 0.0))
    p = predict(ENGINE, SLO, queue, 1, 100, 32, 2000)
    # No decodes yet; while the queue drains, half of its two requests decode: 255 prompt tokens a step,
    # and then its own 100 in a step.
    chunk = 256 - 1
    full = SPEED.step_s(1, chunk)
    assert p.ttft_s == pytest.approx(SPEED.step_s(0, chunk) / 2 + 2000 / chunk * full + SPEED.step_s(1, 100))
    fair = predict(ENGINE, SLO, queue, 1, 100, 32, 500)  # its tenant's share of the queue ahead of it
    assert fair.ttft_s < p.ttft_s


def test_the_wait_for_a_seat_is_the_soonest_finishing_streams() -> None:
    engine = EngineShape(SPEED, 1.0, 256, 4)
    busy = flights((1, 0, 40, 5, 0.05), (1, 0, 3, 5, 0.05), (1, 0, 9, 5, 0.05), (1, 0, 20, 5, 0.05))
    one = predict(engine, SLO, busy, 1, 10, 8, 0)
    two = predict(engine, SLO, busy, 2, 10, 8, 0)
    gap = SPEED.step_s(4, 0)
    assert one.ttft_s == pytest.approx(gap / 2 + 3 * gap + SPEED.step_s(4, 10), rel=1e-6)
    assert two.ttft_s == pytest.approx(gap / 2 + 9 * gap + SPEED.step_s(4, 10), rel=1e-6)
    assert math.isinf(predict(engine, SLO, busy, 5, 10, 8, 0).ttft_s), "more seats than will ever free"


def test_a_prompt_that_would_push_a_stream_past_its_tpot_slo_is_counted() -> None:
    # Two tokens from the end of its output at 43.5 ms a token: two full steps of stall (36 ms each
    # instead of 10.5) make it 52 ms.
    near = (1, 0, 2, 5, 0.24)
    p = predict(ENGINE, SLO, flights(near), 1, 5000, 16, 0)
    assert p.harmed == 1
    small = predict(ENGINE, SLO, flights(near), 1, 20, 16, 0)
    assert small.harmed == 0, "a small prompt shares one step with it"
    already_late = (1, 0, 2, 5, 1.0)
    assert predict(ENGINE, SLO, flights(already_late), 1, 5000, 16, 0).harmed == 0, \
        "a stream that misses anyway is not the new request's doing"


def test_its_own_tpot_is_a_decode_step_of_the_batch_it_joins() -> None:
    p = predict(ENGINE, SLO, flights(*decoding(40), (2, 100, 16, 0, 0.0)), 3, 10, 16, 0)
    assert p.tpot_s == pytest.approx(SPEED.step_s(45, 0))


def load_of(f: Flights) -> Load:
    waiting = f.prompt_tokens > 0
    return Load(int(f.num_seqs.sum()), int(waiting.sum()), int(f.prompt_tokens.sum()), int(waiting.sum()),
                int(f.prompt_tokens.sum()), 0, [], f)


def admit(f: Flights, prompt: int, max_tokens: int = 32, engine: EngineShape = ENGINE,
          settings: AdmissionSettings | None = None) -> str | None:
    rules = settings or AdmissionSettings("slo")
    r = check_admission(rules, engine.seats, load_of(f), 1, 1, prompt, 5000.0, None,
                        Deadlines(engine, SLO, max_tokens))
    return None if r is None else r.message


def test_light_load_is_admitted_and_overload_is_refused_by_deadline() -> None:
    assert admit(flights(), 100) is None
    assert admit(flights(*decoding(4)), 100) is None
    queue = flights(*[(1, 1000, 32, 0, 0.0)] * 10)  # 10,000 prompt tokens: ~4.5 s of work
    message = admit(queue, 100)
    assert message is not None and "TTFT deadline" in message
    assert admit(flights(*decoding(60)), 100, engine=EngineShape(SPEED, 2.0, 256, 64)) is not None, \
        "twice as slow as profiled: a decode step of 61 is 91 ms, past the 50 ms TPOT SLO"
    off = AdmissionSettings("off")
    assert admit(queue, 100, settings=off) is None, "--admission off: the limits only"


def test_an_idle_server_admits_even_when_its_profile_says_it_is_too_slow() -> None:
    slow = EngineShape(SPEED, 50.0, 256, 64)
    assert predict(slow, SLO, flights(), 1, 100, 32, 0).tpot_s > SLO.tpot_s
    assert admit(flights(), 100, engine=slow) is None, "refusing on an idle server helps nobody"


def test_the_live_profile_follows_measured_steps_at_their_size() -> None:
    tracker = SpeedTracker(SPEED)
    for _ in range(300):
        tracker.observe(1, 0, 3 * SPEED.step_s(1, 0))  # one-row decode steps three times as slow as profiled
    live = tracker.speed
    assert live.step_s(1, 0) == pytest.approx(3 * SPEED.step_s(1, 0), rel=0.02)
    assert live.step_s(101, 0) == pytest.approx(SPEED.step_s(101, 0)), "a size not measured keeps its profile"
    decode, prompt = live.parts(1, 800)
    for _ in range(300):  # prompt steps at twice the profile's prompt part
        tracker.observe(1, 800, decode + 2 * prompt)
    d2, p2 = tracker.speed.parts(1, 800)
    assert d2 == pytest.approx(decode, rel=0.02), "the decode part taken as predicted"
    assert p2 == pytest.approx(2 * prompt, rel=0.05)
    for _ in range(300):
        tracker.observe(101, 0, 1000.0)
    assert tracker.speed.step_s(101, 0) == pytest.approx(50 * SPEED.step_s(101, 0), rel=0.01), \
        "clamped: one stalled step is not the engine"


def test_the_profile_never_has_a_bigger_pass_cost_less() -> None:
    assert _monotone([0.5, 0.02, 0.03, 0.01, 0.04]) == (0.01, 0.01, 0.01, 0.01, 0.04)


def test_an_slo_the_idle_engine_misses_is_stretched_to_twice_idle() -> None:
    slow = EngineShape(SPEED, 20.0, 256, 64)  # a decode step of 210 ms, past the 50 ms TPOT SLO
    p = predict(slow, SLO, flights(*decoding(1)), 1, 100, 32, 0)
    assert p.tpot_deadline_s == pytest.approx(2 * slow.step(1, 0))
    assert p.ttft_deadline_s == pytest.approx(max(SLO.ttft_s, 2 * slow.step(0, 100)))
    assert admit(flights(*decoding(1)), 100, engine=slow) is None, "a second stream: a little slower, not 2x"
    assert admit(flights(*decoding(40)), 100, engine=slow) is not None, "40 streams: far past twice idle"


def test_first_tokens_later_than_predicted_make_the_next_predictions_later() -> None:
    from tandem.policy.deadlines import Calibration, predict_ttft

    calibration = Calibration()
    queue = flights(*[(1, 1000, 32, 0, 0.0)] * 3)
    predicted = predict_ttft(ENGINE, queue, 1, 100, 3000)
    assert predicted == pytest.approx(predict(ENGINE, SLO, queue, 1, 100, 32, 3000).ttft_s)
    for _ in range(60):
        calibration.observe(predicted, 3 * predicted)
    assert calibration.ttft == pytest.approx(3.0, rel=0.01)
    calibration.observe(0.005, 10.0)
    assert calibration.ttft == pytest.approx(3.0, rel=0.01), "an idle server's first token says nothing"
    rules = AdmissionSettings("slo")
    late = check_admission(rules, 64, load_of(queue), 1, 1, 100, 5000.0, None, Deadlines(ENGINE, SLO, 32, 1.0))
    assert late is None and predicted < SLO.ttft_s < 3 * predicted
    biased = check_admission(rules, 64, load_of(queue), 1, 1, 100, 5000.0, None,
                             Deadlines(ENGINE, SLO, 32, calibration.ttft))
    assert biased is not None and "TTFT deadline" in biased.message


def test_the_engine_learns_the_time_from_one_step_to_the_next() -> None:
    """The meter hands the speed tracker each step's start-to-next-start time while steps follow each
    other (the core loop's own work and other processes included), not the step's own time; an idle
    pause between two steps is not counted as a slow step."""
    from tandem.engine.request import Request
    from tandem.engine.runner import StepTimings
    from tandem.engine.step import ScheduledRequest, SchedulerOutput
    from tandem.engine.step_meter import StepMeter
    from tandem.sampling_params import SamplingParams

    meter = StepMeter()
    meter.speed = SpeedTracker(SPEED)
    rows = [ScheduledRequest(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=8)), 1, []) for i in range(11)]
    sched = SchedulerOutput(rows)
    period = 3 * SPEED.step_s(11, 0)
    t = 0.0
    for _ in range(300):  # each step's own time as profiled, but the next one starts 3x later
        meter.record(sched, None, 0, 11, 0.0, 0.0, StepTimings(), SPEED.step_s(11, 0), t)
        t += period
    assert meter.speed.speed.step_s(11, 0) == pytest.approx(period, rel=0.02)
    learned = meter.speed.speed.step_s(11, 0)
    meter.idle(0.0)
    meter.record(sched, None, 0, 11, 0.0, 0.0, StepTimings(), SPEED.step_s(11, 0), t + 100.0)
    meter.record(sched, None, 0, 11, 0.0, 0.0, StepTimings(), SPEED.step_s(11, 0), t + 100.0 + period)
    assert meter.speed.speed.step_s(11, 0) == pytest.approx(learned, rel=0.01), "the idle pause is no step's"
