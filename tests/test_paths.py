"""Per-request path choice and the speeds it predicts from, on scripted worker reports: a short
prompt on a lightly loaded decode worker needs no transfer, a long one is disaggregated so its
prefill does not stall the decodes, a stored prompt skips its prefill, a queue moves the choice,
and the learned bias corrects a path that measures slower than predicted."""

from __future__ import annotations

from dataclasses import replace

from tandem.disagg.router.dispatch import Dispatcher
from tandem.disagg.router.flight import Flight
from tandem.disagg.router.registry import WorkerRegistry
from tandem.disagg.router.settings import RouterCounters, RouterSettings
from tandem.disagg.worker.messages import WorkerInfo, WorkerStats
from tandem.disagg.worker.transport import TransferStats
from tandem.engine.core_report import CoreInfo, CoreStats
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.speed import StepSpeed
from tandem.policy.admission import AdmissionSettings, Deadlines, Load, check_admission
from tandem.policy.deadlines import Flights, predict_ttft
from tandem.policy.latency import PRIOR_PREFILL_TOK_S, WorkerRates
from tandem.policy.paths import Slo
from tandem.policy.routing import Router, RoutingSettings
from tandem.sampling_params import SamplingParams

SLO = Slo(ttft_s=2.0, tpot_s=0.1)


def stats(prompt_tokens: int = 0, prompt_s: float = 0.0, steps: int = 0, decode_s: float = 0.0,
          queued: int = 0, transfers: int = 0, exposed_s: float = 0.0) -> WorkerStats:
    core = CoreStats(0, 0, 0.0, 0, 64, 0, 0, 0, 0, 0, 0.0, prompt_s, prompt_tokens, {}, queued, decode_s, steps)
    return WorkerStats(core, TransferStats(transfers_ok=transfers, exposed_s=exposed_s))


def test_rates_come_from_the_differences_between_reports() -> None:
    rates = WorkerRates()
    rates.observe(stats(prompt_tokens=1000, prompt_s=10.0, steps=10, decode_s=10.0))  # history: ignored
    assert rates.prefill_tok_s is None and rates.step_s is None
    rates.observe(stats(prompt_tokens=3000, prompt_s=11.0, steps=20, decode_s=10.5, queued=700,
                        transfers=4, exposed_s=0.4))
    assert rates.prefill_tok_s == 2000.0 and rates.step_s == 0.05 and rates.exposed_transfer_s == 0.1
    assert rates.queued == 700
    rates.sent_prompt_tokens += 300  # routed there since: the next report will include it
    assert rates.queued == 1000
    rates.observe(stats(prompt_tokens=3000, prompt_s=11.0, steps=20, decode_s=10.5, queued=0))
    assert rates.queued == 0 and rates.prefill_tok_s == 2000.0  # nothing new measured: unchanged


class Cluster:
    """A registry of workers with scripted speeds, and the dispatcher that chooses their paths."""

    def __init__(self, *roles: str, paths: str = "slo") -> None:
        self.registry = WorkerRegistry(30.0)
        routing = RoutingSettings("least-loaded", paths=paths, slo=SLO)
        router = Router(routing, self.registry.index, lambda w: 0)
        self.dispatch = Dispatcher(RouterSettings(), self.registry, router, SLO, paths, self._send, self._deliver,
                                   RouterCounters())
        self.dispatch.info = CoreInfo(4096, 100, None, 64, "m", block_size=16)
        self.workers = {}
        for i, role in enumerate(roles):
            wid = f"{role}-{i}"
            info = WorkerInfo(wid, role, self.dispatch.info, None, "h", i, None)
            self.workers[wid] = self.registry.join(wid.encode(), info)

    async def _send(self, worker: object, msg: object) -> bool:
        return True

    async def _deliver(self, outputs: list) -> None:
        pass

    def speed(self, wid: str, prefill_tok_s: float, step_s: float, queued: int = 0, decoding: int = 4) -> None:
        rates = self.workers[wid].rates
        rates.prefill_tok_s, rates.step_s, rates.queued_prompt_tokens = prefill_tok_s, step_s, queued
        rates.decoding = decoding if self.workers[wid].role != "prefill" else 0

    def choose(self, prompt_len: int, max_tokens: int = 64) -> tuple[str, str | None, str]:
        request = EngineCoreRequest(f"r{prompt_len}", tuple(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
        option = self.dispatch.choose(Flight(request))
        assert option is not None
        return option.path, option.prefill.worker_id if option.prefill else None, option.decode.worker_id


def test_short_prompts_stay_on_the_decode_worker_and_long_ones_are_disaggregated() -> None:
    c = Cluster("prefill", "decode")
    c.speed("prefill-0", 2000, 0.05)
    c.speed("decode-1", 2000, 0.05)
    # 32 tokens: a 16 ms prefill, spread over 64 tokens, costs the decodes nothing worth a transfer.
    assert c.choose(32) == ("colocated", None, "decode-1")
    # 2000 tokens: a second of prefill would stall the decodes there by 16 ms a token over 64 tokens.
    assert c.choose(2000) == ("disaggregated", "prefill-0", "decode-1")


def test_a_worker_with_nobody_decoding_stalls_nobody() -> None:
    c = Cluster("prefill", "decode")
    c.speed("prefill-0", 2000, 0.05)
    c.speed("decode-1", 2000, 0.05, decoding=0)
    assert c.choose(2000) == ("colocated", None, "decode-1")


def test_a_one_token_request_has_no_tpot_to_protect() -> None:
    c = Cluster("colocated", "decode")
    c.speed("colocated-0", 2000, 0.05, queued=4000)  # 2 s of prompts ahead
    c.speed("decode-1", 2000, 0.05)
    # Prefilling on the decode worker would stall its decodes by a second a token: the colocated
    # worker computes it, queue and all, and the decode worker is not needed for its one token.
    path, prefill, decode = c.choose(2000, max_tokens=1)
    assert (path, prefill or decode) != ("colocated", "decode-1")


def test_a_queue_on_the_prefill_worker_moves_a_long_prompt_to_the_decode_worker() -> None:
    c = Cluster("prefill", "decode")
    c.speed("decode-1", 2000, 0.05)
    c.speed("prefill-0", 2000, 0.05)
    assert c.choose(2000)[0] == "disaggregated"
    c.speed("prefill-0", 2000, 0.05, queued=8000)  # 4 s of prompts ahead of it: TTFT would miss
    assert c.choose(2000) == ("colocated", None, "decode-1")


def test_the_disaggregated_policy_always_uses_a_pair_when_there_is_one() -> None:
    c = Cluster("prefill", "decode", paths="disaggregated")
    assert c.choose(8)[0] == "disaggregated"
    only_decode = Cluster("decode", paths="disaggregated")
    assert only_decode.choose(8) == ("colocated", None, "decode-0")
    # A colocated worker and a decode worker are a pair as well (the planner's colocated -> decode flip).
    mixed = Cluster("colocated", "decode", paths="disaggregated")
    assert mixed.choose(8) == ("disaggregated", "colocated-0", "decode-1")


def test_colocated_workers_prefill_for_decode_workers() -> None:
    c = Cluster("colocated", "decode")
    # The colocated worker's decode steps carry prompt chunks (its measured step is long); it has
    # nobody decoding now. The decode worker's steps are pure decodes.
    c.speed("colocated-0", 2000, 0.3, decoding=0)
    c.speed("decode-1", 2000, 0.05)
    assert c.choose(2000) == ("disaggregated", "colocated-0", "decode-1")
    assert c.choose(16) == ("colocated", None, "decode-1")


def test_unmeasured_workers_borrow_the_fleets_speed() -> None:
    c = Cluster("prefill", "decode")
    assert c.registry.speed(c.workers["decode-1"]).prefill_tok_s == PRIOR_PREFILL_TOK_S
    c.speed("prefill-0", 3000, 0.04)
    c.workers["decode-1"].rates.prefill_tok_s = None
    assert c.registry.speed(c.workers["decode-1"]).prefill_tok_s == 3000


def test_a_path_that_measures_slower_than_predicted_learns_a_bias() -> None:
    c = Cluster("prefill", "decode")
    c.speed("prefill-0", 2000, 0.05)
    c.speed("decode-1", 2000, 0.05)
    flight = Flight(EngineCoreRequest("r", tuple(range(2000)), SamplingParams(max_tokens=64)))
    assert c.dispatch.choose(flight).path == "disaggregated"
    for _ in range(20):  # every disaggregated request's TTFT measures 1 s over the prediction
        c.dispatch.learn(flight, flight.predicted_ttft_s + 1.0, flight.predicted_tpot_s)
    assert c.choose(2000)[0] == "colocated"


def test_the_registry_reports_feed_the_speeds() -> None:
    c = Cluster("colocated")
    w = c.workers["colocated-0"]
    c.registry.report(w, stats(prompt_tokens=0, prompt_s=0.0))
    c.registry.report(w, stats(prompt_tokens=500, prompt_s=0.5, steps=10, decode_s=0.3))
    speed = c.registry.speed(w)
    assert speed.prefill_tok_s == 1000 and abs(speed.step_s - 0.03) < 1e-12


def test_admission_on_a_router_predicts_with_the_fleet_as_one_engine() -> None:
    """The router's admission runs the single server's predictor (deadlines.predict_ttft), on the fleet
    as one engine built from the same measured speeds the path choice uses: two workers drain a
    queue twice as fast as one, and a request that cannot start within its timeout is refused."""
    one, two = Cluster("colocated"), Cluster("colocated", "colocated")
    for c in (one, two):
        for wid, w in c.workers.items():
            w.info = replace(w.info, core=replace(w.info.core, max_num_seqs=16))  # seats to spare
            c.speed(wid, 2000, 0.05)
    shapes = [c.registry.shape(budget=512, contended_chunk=128) for c in (one, two)]
    assert all(s is not None for s in shapes)
    queue = Flights.of([(1, 8000, 64, 0, 0.0)])  # 8,000 prompt tokens waiting ahead
    waits = [predict_ttft(s, queue, 1, 1000, 8000) for s in shapes]  # type: ignore[arg-type]
    assert 9000 / 2000 <= waits[0] <= 1.3 * 9000 / 2000, waits  # the queue and its own prompt at 2,000 tok/s
    assert 0.45 <= waits[1] / waits[0] <= 0.6, waits
    load = Load(in_flight=1, waiting=1, queued_tokens=8000, tenant_waiting=1, tenant_queued_tokens=8000,
                flights=queue)
    deadlines = Deadlines(shapes[1], SLO, 64)

    def check(timeout_s: float) -> object:
        return check_admission(AdmissionSettings(), 32, load, 1, 1, 1000, 2000.0, timeout_s, deadlines)

    refused = check(1.0)
    assert refused is not None and "cannot start within its timeout" in refused.message
    assert check(30.0) is None


def test_a_lone_profiled_worker_is_predicted_from_its_step_times_as_the_single_server_is() -> None:
    """A cluster of one worker is that engine: admission predicts from the step profile it registered
    with, moved by its reports (the single server's EngineShape), not from rates it has not measured;
    a second worker makes it a fleet again (measured rates)."""
    profiled = StepSpeed((1, 256), (0.01, 0.5), (1, 8), (0.02, 0.04))
    c = Cluster("colocated")
    w = c.workers["colocated-0"]
    w.info = replace(w.info, core=replace(w.info.core, speed=profiled, max_num_seqs=16))
    shape = c.registry.shape(budget=256, contended_chunk=64)
    assert shape is not None and shape.speed == profiled and (shape.factor, shape.budget) == (1.0, 256)
    assert (shape.seats, shape.contended_chunk) == (16, 64)
    # Its engine moved the profile (live steps ran slower): its report's speed is what is predicted from.
    moved = StepSpeed((1, 256), (0.02, 1.0), (1, 8), (0.04, 0.08))
    report = stats()
    c.registry.report(w, replace(report, core=replace(report.core, speed=moved)))
    assert c.registry.shape(budget=256, contended_chunk=64).speed == moved  # type: ignore[union-attr]
    one_step = sum(c.registry.shape(256, 64).speed.parts(1, 0))  # type: ignore[union-attr]
    assert one_step == 0.04

    two = Cluster("colocated", "colocated")
    for wid, worker in two.workers.items():
        worker.info = replace(worker.info, core=replace(worker.info.core, speed=profiled))
        two.speed(wid, 2000, 0.05)
    fleet = two.registry.shape(budget=256, contended_chunk=64)
    assert fleet is not None and not isinstance(fleet.speed, StepSpeed)
