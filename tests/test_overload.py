"""Overload over a real server: a burst far past capacity gets 429s with Retry-After early, never a
5xx or a hang, and everything admitted finishes. (The latency ratios are benchmarks/hostile_traffic.py's.)"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from server_utils import running_server, web

KEYS = ("key-a", "key-b")


async def burst(url: str, n: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as c:
        async def one(i: int) -> httpx.Response:
            return await c.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEYS[i % 2]}"},
                                json={"prompt": f"{i} Tell me about the sea and the ships on it.", "max_tokens": 16,
                                      "temperature": 0, "ignore_eos": True})

        return await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.slow
def test_a_burst_past_capacity_is_refused_early_and_the_rest_served() -> None:
    with running_server("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-seqs", "4",
                        "--admission", "slo", "--seat-overcommit", "1.5", "--admission-ttft-budget", "2",
                        "--api-key", KEYS[0], "--api-key", KEYS[1]) as s:
        responses = asyncio.run(burst(s.url, 60))
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        refused = [r for r in responses if r.status_code == 429]
        assert len(refused) >= 60 - 6, "at most 4 x 1.5 seats are in flight at once"
        for r in refused:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "RateLimitError"
        for r in responses:
            if r.status_code == 200:
                assert r.json()["choices"][0]["finish_reason"] == "length"
        # Once the burst is over, the server serves as before.
        again = asyncio.run(burst(s.url, 2))
        assert [r.status_code for r in again] == [200, 200], [r.text for r in again]
        rejected = [line for line in web.get(f"{s.url}/metrics").text.splitlines()
                    if line.startswith("tandem:request_rejected_total{")]
        assert float(rejected[0].rsplit(" ", 1)[1]) >= len(refused)


@pytest.mark.slow
def test_the_slo_deadline_rule_refuses_a_burst_it_cannot_serve_in_time() -> None:
    """`--admission slo` with tight SLOs: the seat and queue limits never bind (128 seats, no TTFT budget), so
    every refusal is the deadline prediction's, and everything admitted finishes well inside the time
    a request of the burst would take unguarded."""
    with running_server("--dtype", "float32", "--kv-cache-memory", "0.25", "--slo-ttft-ms", "400",
                        "--slo-tpot-ms", "100", "--admission", "slo", "--api-key", KEYS[0], "--api-key", KEYS[1]) as s:
        t0 = time.monotonic()
        responses = asyncio.run(burst(s.url, 80))
        took = time.monotonic() - t0
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429}, codes
        refused = [r for r in responses if r.status_code == 429]
        assert refused, "80 at once cannot all start within 400 ms"
        for r in refused:
            assert int(r.headers["retry-after"]) >= 1
            assert "predicted" in r.json()["error"]["message"] or "would make" in r.json()["error"]["message"]
        served = [r for r in responses if r.status_code == 200]
        assert served and all(r.json()["choices"][0]["finish_reason"] == "length" for r in served)
        assert took < 60, f"the burst took {took:.0f} s"
        again = asyncio.run(burst(s.url, 1))
        assert again[0].status_code == 200, again[0].text


@pytest.mark.slow
def test_a_tenants_flood_is_refused_before_tokenizing_and_another_tenant_is_served() -> None:
    """Tenant A's long prompts cannot start within their 1 s timeout while B's stream runs: after a
    streak of refusals (each tokenized first), the next are refused before tokenizing, one in eight
    still checked in full; B's own request is admitted throughout."""
    from tandem.policy.refusal_streaks import PROBE_EVERY, STREAK

    a, b = ({"Authorization": f"Bearer {k}"} for k in KEYS)
    with running_server("--dtype", "float32", "--kv-cache-memory", "0.25", "--api-key", KEYS[0],
                        "--api-key", KEYS[1]) as s, httpx.Client(timeout=120) as c, \
            c.stream("POST", f"{s.url}/v1/completions", headers=b,
                     json={"prompt": "Tell me a long story.", "max_tokens": 300, "ignore_eos": True,
                           "stream": True}) as stream:
        lines = stream.iter_lines()
        next(lines)  # B is decoding: A's long prompt would wait behind nothing but its own prefill
        long_prompt = "the sea and the ships on it " * 600
        answers = [c.post(f"{s.url}/v1/completions", headers=a,
                          json={"prompt": long_prompt, "max_tokens": 4, "timeout": 1}) for _ in range(STREAK + 16)]
        assert all(r.status_code == 429 and int(r.headers["retry-after"]) >= 1 for r in answers), \
            [r.text for r in answers]
        cheap = ["checked before tokenizing" in r.json()["error"]["message"] for r in answers]
        assert cheap[:STREAK] == [False] * STREAK
        assert cheap[STREAK:] == ([True] * (PROBE_EVERY - 1) + [False]) * (16 // PROBE_EVERY)
        ok = c.post(f"{s.url}/v1/completions", headers=b, json={"prompt": "Hi", "max_tokens": 4, "timeout": 30})
        assert ok.status_code == 200, ok.text
