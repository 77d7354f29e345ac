"""KV-aware routing end to end: a router in front of two colocated workers (real processes).

A prompt that shares a long prefix with an earlier one goes to the worker that cached it; a worker
that restarts empty no longer attracts its old prefixes; greedy outputs equal the offline engine's
whichever worker serves them.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
import zmq
from cluster_utils import TINY, metric, metric_or_zero, run_all, settled, wait_blocks_free, worker_pid
from server_utils import Server, free_port, running_server, web

from tandem import SamplingParams
from tandem.engine.messages import KVEvents
from tandem.sim.cost import DEFAULT_KNOTS, FittedCost, TransferFit

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

# On the tiny random model: these tests are about where requests go, not what the model says.
ARGS = (TINY[0], "--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-batched-tokens", "128",
        "--workers", "2", "--worker-heartbeat-timeout", "3")


@pytest.fixture(scope="module")
def offline(make_llm):  # noqa: ANN001, ANN201
    """The in-process engine on the same model: the outputs any worker must give."""
    return make_llm(model=TINY[0], dtype="float32")


def step_profile(step_s: float) -> FittedCost:
    """A profile whose every step takes step_s, whatever it holds."""
    coefficients = [step_s] + [0.0] * (len(DEFAULT_KNOTS) + 4)
    return FittedCost(coefficients, list(DEFAULT_KNOTS), 1000.0, 30, 1 << 16, {"shm": TransferFit(1e-3, 1e9)},
                      "shm", 0.0, min_step_s=0.0, engine={"max_num_batched_tokens": 128})


def routed(s: Server) -> dict[str, tuple[float, float]]:
    """worker id -> (overlap blocks, prompt blocks) the router recorded for what it sent there."""
    return {w: (metric_or_zero(s, "router_routed_overlap_blocks", worker_id=w),
                metric_or_zero(s, "router_routed_prompt_blocks", worker_id=w)) for w in ("colocated-0", "colocated-1")}


def delta(after: dict, before: dict) -> dict[str, tuple[float, float]]:
    return {w: (after[w][0] - before[w][0], after[w][1] - before[w][1]) for w in after}


def test_shared_prefixes_go_where_they_are_cached(passages: list[str], offline) -> None:  # noqa: ANN001
    doc = " ".join(passages)[:1500]
    texts = [doc + " Summarise it.", doc + " Name its main topic.", "Hello there"]
    greedy = SamplingParams(temperature=0, max_tokens=12)
    expected = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in offline.generate(texts, greedy)]
    events_port = free_port()
    with running_server(*ARGS, "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}") as s:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{events_port}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.5)  # the subscription reaches the router
        assert run_all(s, texts[:1], max_tokens=12) == expected[:1]
        first = routed(s)
        holder = max(first, key=lambda w: first[w][1])
        # The router publishes its workers' prefix-cache events again, each batch naming its worker.
        assert sub.poll(5000), "the router published no KV events"
        published = sub.recv_pyobj()
        sub.close(linger=0)
        assert isinstance(published, KVEvents) and published.worker_id == holder
        assert any(type(e).__name__ == "BlockStored" for e in published.events)
        time.sleep(0.5)  # its KV events reach the router
        assert run_all(s, texts[1:2], max_tokens=12) == expected[1:2]
        second = delta(routed(s), first)
        overlap, blocks = second[holder]
        assert blocks > 0 and overlap >= blocks - 2  # all of the shared document's blocks
        assert all(v == (0, 0) for w, v in second.items() if w != holder)
        assert run_all(s, texts, max_tokens=12) == expected  # whichever worker serves them
        assert metric(s, "router_routed", path="colocated") == 5
        # The holder restarts with an empty pool: the router must not credit it with the document.
        killed = worker_pid(s, holder)
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not rejoined(s, holder, killed):
            assert time.monotonic() < deadline, "the worker did not come back"
            time.sleep(0.5)
        assert metric(s, "router_worker_restarts") == 1
        others = [w for w in first if w != holder]
        before = routed(s)
        # Whoever gets it now, the restarted worker is not credited with the document.
        assert run_all(s, texts[:1], max_tokens=12) == expected[:1]
        after = delta(routed(s), before)
        assert after[holder][0] == 0
        assert sum(after[w][1] for w in [holder, *others]) > 0
        wait_blocks_free(s)
        stored_conversation_through_the_router(s, doc)


def rejoined(s: Server, worker_id: str, old_pid: int) -> bool:
    """The worker is up again in a new process, and has joined the router (started is not enough)."""
    view = web.get(f"{s.url}/v1/cluster", timeout=10).json()
    return any(w["id"] == worker_id and w["state"] == "up" and w["pid"] != old_pid for w in view["workers"])


def stored_conversation_through_the_router(s: Server, doc: str) -> None:
    """A Responses API follow-up through the router finds its history cached on a worker (the stored
    response's KV is retained there and the router goes where the prefix is), and a delete gives the
    blocks back on every worker."""
    url = f"{s.url}/v1/responses"
    model = web.get(f"{s.url}/v1/models", timeout=10).json()["data"][0]["id"]
    first = web.post(url, json={"model": model, "input": doc, "max_output_tokens": 4}, timeout=60)
    first = first.raise_for_status().json()
    used = settled(lambda: metric_or_zero(s, "worker_kv_cache_used_blocks"), lambda v: v > 0)
    assert used > 0, "a stored response's KV is retained"
    second = web.post(url, json={"model": model, "input": "And then?", "previous_response_id": first["id"],
                                   "max_output_tokens": 4}, timeout=60).raise_for_status().json()
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 16
    for response in (first, second):
        assert web.delete(f"{url}/{response['id']}", timeout=10).json()["deleted"]
    wait_blocks_free(s)


def test_the_planner_predicts_that_a_decode_worker_wins_and_turns_a_colocated_worker_into_one(
        passages: list[str], offline, tmp_path) -> None:  # noqa: ANN001
    """The predictive planner on two colocated workers, given profiles in which a colocated worker's
    step is slow and a decode worker's fast (so that the simulator must find that moving a worker to
    decode wins): after enough arrivals one is drained and restarted as a decode worker, no request
    fails meanwhile, the dwell time stops a second move, and then the other (colocated) worker
    prefills for it: greedy outputs equal the offline engine's on either path. (The disaggregated
    path policy makes the path after the flip certain; which path the slo policy takes is
    tests/test_paths.py's.)"""
    profiles = {"colocated": step_profile(0.5), "decode": step_profile(0.001)}
    for role, profile in profiles.items():
        (tmp_path / f"{role}.json").write_text(json.dumps(profile.to_json()))
    args = (*ARGS, "--planner", "on", "--slo-ttft-ms", "100000", "--slo-tpot-ms", "30", "--planner-interval", "1",
            "--planner-dwell", "600", "--path-policy", "disaggregated",
            # Decisions are spaced by the simulator's CPU time over this share; one slow simulation on a
            # busy CI machine spaced the next past the test's 240 s (the share is not what is tested).
            "--planner-cpu-share", "1.0",
            *(f for role in profiles for f in ("--planner-profile", f"{role}={tmp_path / role}.json")))
    texts = [f"{p[:160]} In short," for p in passages[:5]]
    greedy = SamplingParams(temperature=0, max_tokens=6)
    expected = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in offline.generate(texts, greedy)]
    with running_server(*args) as s:
        flips = {"from_role": "colocated", "to_role": "decode"}
        deadline = time.monotonic() + 240
        rounds = 0
        while metric_or_zero(s, "router_planner_flips", **flips) < 1:
            assert time.monotonic() < deadline, "the planner did not act"
            assert run_all(s, texts, max_tokens=6) == expected  # every request succeeds, flip or not
            rounds += 1
        assert rounds >= 2  # it waited for enough evidence (8 arrivals)
        deadline = time.monotonic() + 120
        while metric_or_zero(s, "worker_up", worker="decode-0") != 1:
            assert time.monotonic() < deadline, "the flipped worker did not join as a decode worker"
            time.sleep(0.5)
        assert metric_or_zero(s, "router_routed", path="disaggregated") == 0  # no pair existed before
        assert run_all(s, texts, max_tokens=6) == expected
        assert metric(s, "router_routed", path="disaggregated") == len(texts)
        time.sleep(2)
        assert metric(s, "router_planner_flips", **flips) == 1  # the dwell holds
        # The dashboard's view of it: the action on the planner's timeline, the new worker in the map.
        view = web.get(f"{s.url}/v1/cluster", timeout=10).json()
        jsonschema.validate(view, json.loads((ROOT / "tandem/serve/cluster_schema.json").read_text()))
        planner = view["planner"]
        [action] = planner["actions"]
        assert (action["from_role"], action["to_role"], action["outcome"]) == ("colocated", "decode", "done")
        assert planner["predictive"] and action["predicted_goodput"] > action["baseline_goodput"]
        assert "predicted goodput" in action["reason"]
        assert {o["option"] for o in planner["last_scores"]} >= {"stay at 2C", "colocated -> decode (1D1C)"}
        [record] = [r for r in planner["predictions"] if r["acted"]]
        assert record["predicted_goodput"] == action["predicted_goodput"] and record["measured_goodput"] is None
        assert sorted(w["role"] for w in view["workers"] if w["state"] == "up") == ["colocated", "decode"]
        assert metric(s, "router_worker_deaths") == 0 and metric(s, "router_colocated_fallbacks") == 0
        # Every request measured against its prediction, by the path it took.
        measured = sum(metric_or_zero(s, "router_measured_ttft_seconds_count", path=p)
                       for p in ("colocated", "disaggregated"))
        assert measured == metric(s, "router_predicted_ttft_seconds_count") >= 3 * len(texts)
        wait_blocks_free(s)


def test_a_step_longer_than_the_heartbeat_timeout_is_not_a_death(passages: list[str]) -> None:
    """One prompt chunk of ~1,800 tokens takes seconds on one core: the worker's heartbeat thread keeps
    the router from declaring it dead meanwhile. (~900 tokens took only 2.4 s on an AVX512 EPYC.)
    Then the lone worker is killed while such a prompt waits for its first token: new requests get
    503 and /health is unhealthy until it is back, and the waiting request is not failed but runs on
    the worker started again (as the single server's core restart does)."""
    args = ("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-batched-tokens", "2048", "--workers", "1",
            "--worker-heartbeat-timeout", "2")
    text = (" ".join(passages) + " ") * 2  # ~1,800 tokens: one chunk of the 2,048-token budget
    with running_server(*args) as s:
        t0 = time.monotonic()
        [(_, reason)] = run_all(s, [text], max_tokens=2)
        assert reason == "length"
        assert time.monotonic() - t0 > 2.5, "the step was too short to test anything; use a longer prompt"
        assert metric(s, "router_worker_deaths") == 0

        waiting: dict[str, httpx.Response] = {}
        other = (" ".join(passages[::-1]) + " ") * 2  # not cached: seconds of prefill still to come
        thread = threading.Thread(target=lambda: waiting.update(r=web.post(
            f"{s.url}/v1/completions", json={"prompt": other, "max_tokens": 2, "ignore_eos": True}, timeout=240)))
        thread.start()
        time.sleep(0.5)
        killed = worker_pid(s, "colocated-0")
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while web.get(f"{s.url}/health").status_code == 200:
            assert time.monotonic() < deadline, "the router did not notice its only worker died"
            time.sleep(0.1)
        refused = web.post(f"{s.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=10)
        assert refused.status_code == 503 and "error" in refused.json()
        thread.join(240)
        assert waiting["r"].status_code == 200, waiting["r"].text
        assert waiting["r"].json()["choices"][0]["finish_reason"] == "length"
        assert rejoined(s, "colocated-0", killed) and metric(s, "router_worker_deaths") == 1
        assert metric(s, "router_worker_restarts") == 1
