"""Prefill/decode disaggregation end to end: a router and real worker processes over real sockets.

Greedy float32 outputs of a 1P1D deployment equal the colocated server's, with prefix caching and
chunked prefill on; killing a worker mid-stream fails its clients fast and leaves the rest serving;
abort storms leave no block allocated on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from cluster_utils import (
    TINY,
    metric,
    metric_or_zero,
    prompts,
    run_all,
    settled,
    wait_blocks_free,
    worker_pid,
)
from server_utils import Server, children, running_server, torch_mapped, web

from tandem.disagg.fleet.local_launcher import assign_cores

pytestmark = pytest.mark.slow

# Every prompt through the pair (not the per-request path choice): these tests are about the transfer.
DISAGG = ("--prefill-workers", "1", "--decode-workers", "1",
          "--path-policy", "disaggregated")


# A short prompt and a long one (chunked prefill, many blocks).
LOGPROB_PROMPTS = slice(2, 4)


def echo_logprobs(server: Server, prompt: str) -> list[tuple[list[str], list[float | None]]]:
    """A log-likelihood request (echo + logprobs: the prompt scored, then 8 greedy tokens), n=2:
    per choice, its tokens (the prompt's and the generated) and their logprobs."""
    body = {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 8, "temperature": 0, "n": 2}
    r = web.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [(c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) for c in r.json()["choices"]]


@pytest.fixture(scope="module")
def colocated_outputs(passages: list[str]) -> dict[str, list]:
    """What the colocated server answers: greedy twice (the second round from its prefix cache), seeded,
    and, after those, the log-likelihood requests (LOGPROB_PROMPTS) that the 1P1D deployment must score alike."""
    with running_server(*TINY) as s:
        texts = prompts(passages)
        return {
            "greedy": run_all(s, texts),
            "again": run_all(s, texts),
            "seeded": run_all(s, texts[:3], temperature=0.9, seed=1234),
            "logprobs": [echo_logprobs(s, t) for t in texts[LOGPROB_PROMPTS]],
        }


@pytest.fixture(scope="module")
def disagg_server() -> Server:  # noqa: ANN201 (a generator fixture)
    """One 1P1D deployment (shared-memory transport), shared by the tests in this file that need no other
    flags. The kill tests kill a worker in it and wait until the router has started it again and the
    deployment is whole, so the tests after them get a whole deployment too; the heartbeat timeout is
    theirs (a killed worker is declared dead within seconds)."""
    with running_server(*TINY, *DISAGG, "--worker-heartbeat-timeout", "3") as s:
        yield s


@pytest.mark.parametrize("transport", ["shm", "zmq"])
def test_1p1d_greedy_outputs_equal_colocated(transport: str, colocated_outputs: dict, passages: list[str],
                                             request: pytest.FixtureRequest) -> None:
    with contextlib.ExitStack() as stack:
        s = (request.getfixturevalue("disagg_server") if transport == "shm"
             else stack.enter_context(running_server(*TINY, *DISAGG, "--kv-transport", transport)))
        texts = prompts(passages)
        transfers, fallbacks = metric_or_zero(s, "kv_transfers", outcome="ok"), metric(s, "router_colocated_fallbacks")
        sent_before = metric_or_zero(s, "kv_transfer_sent_bytes")

        def sent_after(moved: int) -> float:
            """The bytes sent, once the workers have reported `moved` more transfers than before."""
            settled(lambda: metric(s, "kv_transfers", outcome="ok") - transfers, lambda n: n >= moved)
            return metric(s, "kv_transfer_sent_bytes") - sent_before

        assert run_all(s, texts) == colocated_outputs["greedy"]
        sent_first = sent_after(len(texts))
        # The second round hits the decode worker's prefix cache: those blocks are not sent again.
        assert run_all(s, texts) == colocated_outputs["again"]
        sent_second = sent_after(2 * len(texts)) - sent_first
        assert 0 < sent_second < sent_first
        # Seeded sampling: a position's noise comes from (seed, position), on whichever worker samples it.
        seeded = run_all(s, texts[:3], temperature=0.9, seed=1234)
        assert seeded == colocated_outputs["seeded"]
        sent_after(2 * len(texts) + 3)
        assert metric(s, "kv_transfers", outcome="ok") - transfers == 2 * len(texts) + 3
        assert metric(s, "router_colocated_fallbacks") == fallbacks
        assert metric(s, "prefix_cache_hits") > 0
        if transport == "zmq":
            assert metric(s, "kv_transfer_received_bytes") == metric(s, "kv_transfer_sent_bytes")
        wait_blocks_free(s)


def test_1p1d_prompt_logprobs_equal_colocated(passages: list[str], colocated_outputs: dict,
                                              disagg_server: Server) -> None:
    """The prefill worker scores the prompt; its logprobs reach the response through the router:
    the same tokens and (float32, greedy) the same logprobs as colocated, with the KV transferred."""
    texts = prompts(passages)[LOGPROB_PROMPTS]
    wants = colocated_outputs["logprobs"]
    s = disagg_server
    transfers, fallbacks = metric_or_zero(s, "kv_transfers", outcome="ok"), metric(s, "router_colocated_fallbacks")
    got = [echo_logprobs(s, t) for t in texts]
    for text, choices, want in zip(texts, got, wants, strict=True):
        assert len(choices) == 2
        for (tokens, lps), (want_tokens, want_lps) in zip(choices, want, strict=True):
            assert tokens == want_tokens and "".join(tokens).startswith(text)
            assert lps[0] is None and want_lps[0] is None and len(lps) == len(want_lps)
            assert lps[1:] == pytest.approx(want_lps[1:], abs=1e-4)
    # n=2: each prompt moved at least once (the second child may find the first's blocks already on
    # the decode worker's prefix cache and move none, when the prefill beats it there).
    moved = settled(lambda: metric(s, "kv_transfers", outcome="ok") - transfers, lambda n: n >= len(texts))
    assert len(texts) <= moved <= 2 * len(texts)
    assert metric(s, "router_colocated_fallbacks") == fallbacks
    wait_blocks_free(s)


def test_streaming_through_the_router_equals_non_streaming(disagg_server: Server) -> None:
    s = disagg_server
    client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "Name three colours."}]
    full = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
    chunks = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    # The same errors as the colocated server.
    r = web.post(f"{s.url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
    wait_blocks_free(s)
    # The router process parses, tokenizes and routes without torch (its workers alone compute): after the
    # requests above none of torch's libraries is mapped into it, while both workers' are.
    assert not torch_mapped(s.proc.pid)
    assert len([pid for pid in children(s.proc.pid) if torch_mapped(pid)]) == 2


def _stream_until_error(url: str, model: str, result: dict, key: int, max_tokens: int,
                        decoding: threading.Semaphore) -> None:
    """Stream a long generation; record when it ended and whether with an error (decoding: released
    at its first token)."""
    body = {"model": model, "prompt": "Tell me a long story about a dragon.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    t_first = None
    try:
        with web.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if t_first is None and line.startswith("data: {"):
                    t_first = time.monotonic()
                    decoding.release()
                if '"error"' in line:
                    result[key] = ("error", time.monotonic())
                    return
        result[key] = ("done", time.monotonic())
    except httpx.HTTPError:
        result[key] = ("error", time.monotonic())


def _start_streams(url: str, model: str, results: dict[int, tuple[str, float]], max_tokens: int) -> list:
    """Three streams, returned once each is decoding. max_tokens: enough that they still decode
    seconds later (the tiny model streams a token in a few milliseconds)."""
    decoding = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream_until_error, args=(url, model, results, i, max_tokens, decoding))
               for i in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert decoding.acquire(timeout=60), "a stream never started"
    return threads


def _wait_health(s: Server, status: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        report = web.get(f"{s.url}/health", timeout=5)
        assert report.status_code == 200, report.text  # degraded still serves
        if report.json()["status"] == status or time.monotonic() > deadline:
            return report.json()
        time.sleep(0.2)


def _deaths_and_restarts(s: Server) -> tuple[float, float]:
    return metric_or_zero(s, "router_worker_deaths"), metric_or_zero(s, "router_worker_restarts")


def _still_serving(s: Server, model: str, victim: str, before: tuple[float, float]) -> None:
    """``before``: the router's deaths and restarts before the kill (the deployment is shared)."""
    deaths, restarts = before
    # New requests are served meanwhile (colocated on the survivor while the pair is broken).
    out = web.post(f"{s.url}/v1/completions", json={"model": model, "prompt": "The capital of France is",
                                                      "max_tokens": 8, "temperature": 0}, timeout=60)
    assert out.status_code == 200 and out.json()["choices"][0]["text"]
    assert metric(s, "router_worker_deaths") == deaths + 1
    # The router starts the dead worker again; once it has joined, the deployment is whole.
    assert _wait_health(s, "ok")["status"] == "ok"
    assert metric(s, "worker_up", worker=victim) == 1
    assert metric(s, "router_worker_restarts") == restarts + 1
    wait_blocks_free(s)


def test_kill_the_decode_worker_mid_stream(disagg_server: Server) -> None:
    s = disagg_server
    before = _deaths_and_restarts(s)
    model = web.get(f"{s.url}/v1/models").json()["data"][0]["id"]
    results: dict[int, tuple[str, float]] = {}
    threads = _start_streams(s.url, model, results, max_tokens=6000)
    os.kill(worker_pid(s, "decode-0"), signal.SIGKILL)
    killed = time.monotonic()
    assert _wait_health(s, "degraded", 10)["reasons"] == ["no live decode worker"]
    for t in threads:
        t.join(90)
    # Every stream lived on the decode worker: each gets an error, within seconds.
    assert len(results) == 3
    for outcome, when in results.values():
        assert outcome == "error" and when - killed < 10
    _still_serving(s, model, "decode-0", before)


def test_kill_the_prefill_worker_mid_stream_and_mid_prompt(passages: list[str], disagg_server: Server) -> None:
    """Streams already decoding carry on untouched; prompts caught mid-prefill have streamed
    nothing, so they are retried on the survivor and succeed."""
    s = disagg_server
    before = _deaths_and_restarts(s)
    model = web.get(f"{s.url}/v1/models").json()["data"][0]["id"]
    long = " ".join(passages)[:3000]
    results: dict[int, tuple[str, float]] = {}
    threads = _start_streams(s.url, model, results, max_tokens=1500)  # they outlast the kill
    victim = worker_pid(s, "prefill-0")

    async def prompts_in_flight() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as c:
            # Stopped, the prefill worker holds the prompts sent to it unfinished, however fast the model.
            os.kill(victim, signal.SIGSTOP)
            tasks = [asyncio.create_task(c.post(f"{s.url}/v1/completions", json={
                "model": model, "prompt": f"{i} {long}", "max_tokens": 4, "temperature": 0})) for i in range(3)]
            await asyncio.sleep(1.0)  # routed to it by now
            os.kill(victim, signal.SIGKILL)
            report = await asyncio.to_thread(_wait_health, s, "degraded", 10)
            assert report["reasons"] == ["no live prefill worker"]
            return [(await t).status_code for t in tasks]

    assert asyncio.run(prompts_in_flight()) == [200, 200, 200]
    for t in threads:
        t.join(90)
    assert sorted(outcome for outcome, _ in results.values()) == ["done"] * 3
    _still_serving(s, model, "prefill-0", before)


def test_abort_storm_leaves_no_blocks(passages: list[str], disagg_server: Server) -> None:
    s = disagg_server
    model = web.get(f"{s.url}/v1/models").json()["data"][0]["id"]
    long = " ".join(passages)[:2000]

    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": model, "prompt": f"{i} {long if i % 2 else 'Tell me a story.'}", "max_tokens": 64,
                "temperature": 0, "stream": i % 3 == 0}
        # Cut at every phase: while routing, mid-prefill/transfer, and mid-decode.
        with contextlib.suppress(TimeoutError, httpx.HTTPError):
            await asyncio.wait_for(c.post(f"{s.url}/v1/completions", json=body), timeout=0.05 + 0.25 * (i % 8))

    async def main() -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(one(c, i) for i in range(24)))

    asyncio.run(main())
    wait_blocks_free(s, timeout=30)
    # And it still serves.
    r = web.post(f"{s.url}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200


def test_workers_join_by_address_and_a_wrong_secret_is_refused() -> None:
    from server_utils import free_port

    from tandem.disagg.worker.wire import SECRET_ENV

    port = free_port()
    router = f"tcp://127.0.0.1:{port}"
    server = Server([*TINY, "--router-bind", router, "--path-policy", "disaggregated"],
                    env={SECRET_ENV: "the-secret"})
    workers: list[subprocess.Popen] = []

    def worker(role: str, secret: str, worker_id: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "tandem.cli", "worker", "--role", role, "--router", router, "--worker-id",
               worker_id, *TINY, *extra]
        workers.append(subprocess.Popen(cmd, env={**os.environ, SECRET_ENV: secret}, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL))

    try:
        # The router serves once a worker has joined; the intruder, lacking the secret, never does.
        worker("decode", "a-guess", "intruder")
        (prefill_core,), (decode_core,) = assign_cores(2, None)  # as `tandem serve` places its own two
        worker("prefill", "the-secret", "p0", "--cores", str(prefill_core))
        worker("decode", "the-secret", "d0", "--cores", str(decode_core), "--kv-transport", "zmq")
        server.wait_ready()
        deadline = time.monotonic() + 180
        while metric_or_zero(server, "worker_up") < 2:
            assert time.monotonic() < deadline, "workers did not join"
            time.sleep(0.5)
        time.sleep(2)  # the intruder has loaded and is knocking by now
        assert workers[0].poll() is None
        text = web.get(f"{server.url}/metrics").text
        assert 'worker="intruder"' not in text and 'worker="d0"' in text and 'worker="p0"' in text
        r = web.post(f"{server.url}/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 8,
                                                             "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert settled(lambda: metric(server, "kv_transfers", outcome="ok"), lambda n: n == 1) == 1
        sent_received = settled(lambda: (metric(server, "kv_transfer_received_bytes"),
                                         metric(server, "kv_transfer_sent_bytes")), lambda v: v[0] == v[1] > 0)
        assert sent_received[0] == sent_received[1] > 0
    finally:
        server.stop()
        for w in workers:
            w.terminate()
            try:
                w.wait(30)
            except subprocess.TimeoutExpired:
                w.kill()


def test_the_store_sends_returning_prompts_straight_to_a_decode_worker(colocated_outputs: dict, passages: list[str],
                                                                       tmp_path: object) -> None:
    """Blocks another engine saved (here an offline one, in this process) are loaded by the decode
    worker: a prompt the store holds, all but its last block, skips the prefill worker."""
    from tandem import LLM, SamplingParams

    texts = prompts(passages)[3:]  # the long ones: the short ones have no full block to store
    disk = ("--kv-offload-disk", f"{tmp_path}/kv", "--kv-offload-disk-size", "0.2")
    offline = LLM(TINY[0], dtype="float32", kv_cache_memory=0.05, kv_offload_disk=f"{tmp_path}/kv",
                  kv_offload_disk_size=0.2)
    offline.generate(texts, SamplingParams(temperature=0, max_tokens=1))
    offline.engine.core.close()  # every block is on disk
    with running_server(*TINY, *DISAGG, "--kv-offload-memory", "0.05", *disk) as s:
        assert run_all(s, texts) == colocated_outputs["greedy"][3:]
        assert metric(s, "router_prefill_free") >= 2  # the long prompts at least
        assert settled(lambda: metric_or_zero(s, "kv_store_hits", tier="disk"), lambda n: n > 0) > 0
        assert metric(s, "kv_store_verify_failures", tier="disk") == 0
        wait_blocks_free(s)


@pytest.mark.parametrize("role,transport", [("prefill", "shm"), ("decode", "zmq")])
def test_a_tp2_worker_group_in_1p1d_equals_colocated(colocated_outputs: dict, passages: list[str], role: str,
                                                     transport: str) -> None:
    """One worker is a group of two ranks (2 and 1 of the default model's 3 KV heads), the other one
    process: rank 0 of the group reads or writes every rank's heads of each block (kv/pool.py), so
    the KV is re-split by head on its way and the answers are the colocated server's."""
    with running_server(*TINY, *DISAGG, "--kv-transport", transport,
                        f"--{role}-worker-args", "--tensor-parallel-size 2") as s:
        texts = prompts(passages)
        transfers = metric_or_zero(s, "kv_transfers", outcome="ok")
        assert run_all(s, texts) == colocated_outputs["greedy"]
        moved = settled(lambda: metric(s, "kv_transfers", outcome="ok") - transfers, lambda n: n >= len(texts))
        assert moved == len(texts)
        ranks = subprocess.run(["pgrep", "-f", "tandem.engine.worker_group"], capture_output=True, text=True)
        assert ranks.stdout.split(), f"the {role} worker runs no group"
