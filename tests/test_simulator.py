"""The simulator: hand-computed timelines, the engine's own scheduling decisions replayed, cost
fits, the planner's search on a toy profile with a known optimum, and the CLI's result files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tandem.bench.compare import compare_files
from tandem.config import CacheConfig, SchedulerConfig
from tandem.engine.request import Request
from tandem.sampling_params import SamplingParams
from tandem.sim.cluster import ClusterSim, Deployment, SimSession, SimTurn
from tandem.sim.cost import DEFAULT_KNOTS, FittedCost, RooflineCost, StepShape, TransferFit, fit_steps
from tandem.sim.hardware import gpu
from tandem.sim.instance import SimInstance
from tandem.sim.model_shape import PRESETS
from tandem.sim.plan import Planner

A, B = 0.010, 0.0005  # a step costs 10 ms plus 0.5 ms a token


def linear_cost(a: float = A, b: float = B, kv_tokens: int = 1 << 16, hop: float = 0.0,
                transfer: TransferFit | None = None, kv_bytes: float = 1000.0, layers: int = 4) -> FittedCost:
    coefficients = [a, b] + [0.0] * (len(DEFAULT_KNOTS) + 3)
    return FittedCost(coefficients, list(DEFAULT_KNOTS), kv_bytes, layers, kv_tokens,
                      {"shm": transfer or TransferFit(0.0, 1e12)}, "shm", hop, min_step_s=0.0)


def run(deployment: str, sessions: list[SimSession], cost: FittedCost, **sched: object):  # noqa: ANN201
    cfg = SchedulerConfig(**sched)  # type: ignore[arg-type]
    return ClusterSim(Deployment.parse(deployment, path_policy="disaggregated"), {"colocated": cost}, cfg,
                      CacheConfig(), 4096, record_steps=True).run(sessions)


def prompt(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(2, 30000, n).tolist()


def test_one_request_colocated_is_computed_exactly():
    res = run("1C", [SimSession([SimTurn(prompt(100), 5)], 0.0)], linear_cost())
    (r,) = res.records
    prefill, decode = A + 100 * B, A + B
    assert r.success and r.output_tokens == 5
    assert r.ttft == pytest.approx(prefill, abs=1e-12)
    assert r.latency == pytest.approx(prefill + 4 * decode, abs=1e-12)
    assert r.tpot == pytest.approx(decode, abs=1e-12)


def test_a_queue_of_equal_requests_is_computed_exactly():
    # Chunking off and a budget of one prompt: each prompt waits for the one before it to finish
    # (a decode token leaves too little budget for a whole prompt).
    n, p, out = 4, 100, 3
    sessions = [SimSession([SimTurn(prompt(p, i), out)], 0.0) for i in range(n)]
    res = run("1C", sessions, linear_cost(), max_num_batched_tokens=p, enable_chunked_prefill=False)
    prefill, decode = A + p * B, A + B
    per_request = prefill + (out - 1) * decode
    for i, r in enumerate(res.records):
        assert r.ttft == pytest.approx(i * per_request + prefill, abs=1e-12)
        assert r.latency == pytest.approx((i + 1) * per_request, abs=1e-12)


def test_one_disaggregated_request_follows_the_protocol_exactly():
    hop, lat, bw, kv_bytes, layers = 0.001, 0.002, 1e6, 1000.0, 4
    cost = linear_cost(hop=hop, transfer=TransferFit(lat, bw), kv_bytes=kv_bytes, layers=layers)
    p, out = 200, 4
    res = run("1P1D", [SimSession([SimTurn(prompt(p), out)], 0.0)], cost)
    (r,) = res.records
    prefill_start = 3 * hop  # reserve on the decode side, reserved back, prefill out
    prefill = A + p * B
    wire = p * kv_bytes / bw
    link_free = prefill_start + prefill / layers + wire
    landed = max(link_free, prefill_start + prefill + wire / layers) + lat
    assert r.ttft == pytest.approx(landed + hop, abs=1e-12)
    # Admit reaches the decode worker one hop later; its tokens stream back through the router.
    second = landed + 2 * hop + (A + B) + hop
    assert r.itl[0] == pytest.approx(second - (landed + hop), abs=1e-12)
    assert r.itl[1:] == pytest.approx([A + B] * (out - 2), abs=1e-12)
    assert r.output_tokens == out


def test_deployment_specs():
    assert Deployment.parse("2P4D") == Deployment(0, 2, 4)
    assert Deployment.parse("1p1d1c").describe() == "1P1D1C"
    assert Deployment.parse("2D").decode_alone
    for bad in ("", "2X", "1P", "P1D", "0C"):
        with pytest.raises(ValueError):
            Deployment.parse(bad)


def test_the_simulated_scheduler_decides_as_the_engine_did(make_llm):
    """The engine's step log (which requests got how many tokens, every step) against the
    simulator's on the same requests: prefix hits, chunked prefill and preemption included."""
    llm = make_llm(dtype="float32", num_blocks=28, max_num_batched_tokens=96, max_num_seqs=6)
    core = llm.engine.core
    rng = np.random.default_rng(3)
    shared = rng.integers(2, 4000, 64).tolist()
    specs = [(shared + rng.integers(2, 4000, n).tolist(), out) for n, out in
             [(40, 30), (120, 20), (10, 40), (70, 25), (5, 60), (90, 10), (33, 33), (150, 5)]]
    core.meter.step_log = log = []
    for i, (ids, out) in enumerate(specs):
        core.add_request(Request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)))
    while core.has_unfinished():
        core.step()
    core.meter.step_log = None
    engine_steps = [[(rid, n) for rid, n, _, _ in s.scheduled] for s in log]
    assert core.scheduler.num_preemptions > 0, "the pool must be small enough to preempt"

    cfg = core.config
    sim = SimInstance("c0", "colocated", linear_cost(kv_tokens=core.num_blocks * cfg.cache.block_size),
                      cfg.scheduler, cfg.cache, core.max_model_len, record_steps=True)
    for i, (ids, out) in enumerate(specs):
        sim.add(Request(f"r{i}", ids, SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)))
    t = 0.0
    while (end := sim.start_step(t)) is not None:
        sim.finish_step(lambda ev: None)
        t = end
    assert [s.scheduled for s in sim.steps] == engine_steps
    assert sim.scheduler.num_preemptions == core.scheduler.num_preemptions


def test_fit_recovers_a_known_cost():
    rng = np.random.default_rng(0)
    truth = [0.004, 2e-5, 0.0, 0.0, 1e-5, 0.0, -5e-6, 3e-5, 4e-9, 2e-8]
    shapes = []
    for _ in range(80):
        n = int(rng.integers(1, 1500))
        items = [(n, int(rng.integers(0, 1000)), True)] + [(1, int(rng.integers(0, 2000)), True)
                                                          for _ in range(int(rng.integers(0, 30)))]
        shapes.append(StepShape.of(items))
    model = FittedCost(truth, list(DEFAULT_KNOTS), 0, 1, 0, min_step_s=0.0)
    seconds = [model.step_time(s) for s in shapes]
    fitted = FittedCost(fit_steps(shapes, seconds), list(DEFAULT_KNOTS), 0, 1, 0, min_step_s=0.0)
    for s, t in zip(shapes, seconds, strict=True):
        assert fitted.step_time(s) == pytest.approx(t, rel=1e-6)


def test_roofline_prices_decode_by_bytes_and_prefill_by_flops():
    m = PRESETS["llama-13b"]
    hw = gpu("H100")
    one = RooflineCost(hw, m, 1)
    decode = one.step_time(StepShape.of([(1, 100, True)]))
    bytes_time = (m.weight_bytes + 101 * m.kv_bytes_per_token) / (hw.mem_bandwidth * hw.memory_efficiency)
    assert decode == pytest.approx(bytes_time + hw.step_overhead_s, rel=1e-9)
    prefill = one.step_time(StepShape.of([(2048, 0, True)]))
    flops = 2 * m.linear_params_per_token() * 2048 + 2 * m.lm_head_params
    assert prefill > flops / (hw.flops * hw.compute_efficiency)
    two = RooflineCost(hw, m, 2)
    assert two.step_time(StepShape.of([(2048, 0, True)])) < 0.6 * prefill  # tp 2: half the work, plus all-reduces
    assert two.kv_capacity_tokens() > 2 * one.kv_capacity_tokens()  # the weights are split too
    ds = PRESETS["deepseek-v3"]
    assert ds.total_params == pytest.approx(671e9, rel=0.01)
    assert ds.linear_params_per_token() + ds.lm_head_params == pytest.approx(37e9, rel=0.05)
    assert ds.kv_bytes_per_token == 61 * 576 * 2


def test_plan_finds_the_known_optimum():
    """Decode steps batch almost for free and a prompt step holds a stream's token for 60 ms: against a
    TPOT SLO of 30 ms every prompt a colocated instance takes costs its streams, and one decode
    instance keeps up with up to four prefill instances, so the best per GPU is the largest
    prefill:decode ratio allowed (4P1D), and colocation is well behind it."""
    cost = linear_cost(a=0.010, b=0.0005, hop=0.0)
    sessions = [SimSession([SimTurn(prompt(100, i), 20)], 0.0) for i in range(600)]
    planner = Planner(lambda role, tp: cost, sessions, {"ttft": 300.0, "tpot": 30.0}, SchedulerConfig(),
                      CacheConfig(enable_prefix_caching=False), 4096, target=0.9, iterations=5, span_s=5.0)
    rows = planner.search([1], max_gpus=5, max_instances=4, start_rate=4.0)
    best = rows[0].candidate
    assert (best.deployment.prefill, best.deployment.decode) == (4, 1), [r.candidate.describe() for r in rows]
    colocated = next(r for r in rows if not r.candidate.deployment.is_disaggregated)
    assert colocated.goodput_per_gpu < 0.7 * rows[0].goodput_per_gpu
    # The phases alone: a prefill instance and a decode instance, and the split their ratio implies.
    prefill, decode = (next(r for r in planner.simulated if r.phase == p) for p in ("prefill", "decode"))
    assert 3 * prefill.goodput < decode.goodput < 5 * prefill.goodput
    assert rows[0].goodput == pytest.approx(4 * prefill.goodput)
    assert rows[0].verified is not None and rows[0].verified > 0.5


def test_bench_sim_writes_a_result_that_compare_reads(tmp_path, capsys):
    from tandem.cli import main

    profile = tmp_path / "h100.json"
    assert main(["profile", "--gpu", "H100", "--model-shape", "llama-8b", "-o", str(profile)]) == 0
    results = []
    for dep in ("1C", "1P1D"):
        out = tmp_path / f"{dep}.json"
        assert main(["bench", "sim", "--profile", str(profile), "--deployment", dep, "--num-prompts", "40",
                     "--request-rate", "8", "--random-input-len", "256", "--random-output-len", "32", "--goodput",
                     "ttft:200", "tpot:40", "--save-result", "--result-dir", str(tmp_path), "--result-filename",
                     out.name, "--label", dep]) == 0
        results.append(out)
    data = json.loads(results[1].read_text())
    assert data["backend"] == "tandem-sim" and data["deployment"] == "1P1D" and data["completed"] == 40
    assert data["total_output_tokens"] == 40 * 32 and data["gpus"] == 2
    table = compare_files(results)
    assert "median_ttft_ms" in table and "1P1D/1C" in table
    capsys.readouterr()
    assert main(["bench", "sim", "--profile", str(profile), "--deployment", "3X"]) == 2
    assert "deployment" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.whole_machine  # times one core beside a neighbour on another, and `tandem serve` on all of them
def test_tandem_profile_measures_the_live_engine(tmp_path):
    out = tmp_path / "p.json"
    # Pinned to one core, as a worker is: the co-location term is timed beside a neighbour on the other.
    proc = subprocess.run([sys.executable, "-m", "tandem.cli", "profile", "--quick", "--kv-cache-memory", "0.25",
                           "--transports", "shm", "--cores", "0", "--num-threads", "1", "-o", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    cost = FittedCost.from_json(data)
    assert data["meta"]["fit_error"]["median"] < 0.25
    small, big = (cost.step_time(StepShape.of([(n, 0, True)])) for n in (16, 256))
    assert 0 < small < big
    assert cost.transports["shm"].bandwidth > 1e8
    assert cost.engine["max_num_batched_tokens"] == 1024
    # The serving calibration ran the same engine behind `tandem serve`: a scale near one, small overheads.
    scale, overhead, per_seq = cost.serving
    assert 0.5 < scale < 3 and 0 <= overhead < 0.05 and 0 <= per_seq < 0.01
    assert len(data["meta"]["serving_points"]) == 3
    if (os.cpu_count() or 1) > 1:
        rule = cost.neighbours
        assert rule is not None and set(rule.slowdown) == {"prefill", "decode"}
        assert all(set(row) == {"prefill", "decode"} and min(row.values()) >= 0 for row in rule.slowdown.values())
        assert rule.meta["neighbour_cores"] and all(t > 0 for row in rule.meta["beside_s"].values()
                                                    for t in row.values())
        assert "co-location: prefill beside prefill" in proc.stdout


def test_expert_rebalancing_evens_a_skewed_load():
    from tandem.sim.moe import contiguous_loads, eplb_loads, expert_popularity

    uniform = expert_popularity(256, 0.0)
    assert contiguous_loads(uniform, 32).max() == pytest.approx(1 / 32)
    skewed = expert_popularity(256, 0.8, seed=1)
    for width in (8, 32, 128):
        before, after = contiguous_loads(skewed, width), eplb_loads(skewed, width, width)
        assert before.sum() == pytest.approx(1.0) and after.sum() == pytest.approx(1.0)
        assert after.max() / after.mean() < before.max() / before.mean()
        assert after.max() / after.mean() < 1.25


def test_moe_decode_pool_meets_its_slo_and_overlap_only_helps():
    from tandem.sim.moe import MoEDecode, plan_expert_parallel

    hw, m = gpu("H200"), PRESETS["deepseek-v3"]
    slo = 0.05
    for width in (16, 64):
        plain = MoEDecode(hw, m, width, eplb=True)
        overlapped = MoEDecode(hw, m, width, eplb=True, dbo=True)
        assert all(overlapped.step_time(b) <= plain.step_time(b) for b in (1, 32, 128))
        b = plain.best_batch(slo)
        assert plain.step_time(b) <= slo
        assert b == plain.max_batch_by_memory() or plain.step_time(b + 1) > slo
        assert plain.step_time(64) > plain.step_time(8)
    rows = plan_expert_parallel(hw, m, [8, 32, 128], slo)
    best = max(rows, key=lambda r: r.tokens_per_gpu)
    assert best.variant == "eplb+dbo"
    contiguous = {r.width: r for r in rows if r.variant == "contiguous"}
    assert contiguous[128].imbalance > contiguous[8].imbalance  # fewer experts a GPU: less averaging


def test_tandem_plan_prints_the_expert_parallel_choice(tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "ep.json"
    assert main(["plan", "--model-shape", "deepseek-v3", "--gpu", "H200", "--slo-tpot", "50", "--ep-widths",
                 "8,32,128", "--output", str(out)]) == 0
    assert "choice: EP width" in capsys.readouterr().out
    rows = json.loads(out.read_text())
    assert {r["width"] for r in rows} == {8, 32, 128} and len(rows) == 9
    assert main(["plan", "--model-shape", "llama-13b", "--slo-tpot", "50"]) == 2
    assert "--slo-ttft" in capsys.readouterr().err
