"""The server as a user first meets it: `tandem serve` with the shipped defaults (admission `queue`,
bfloat16 where native, batch-invariant kernels, the native layer stack; only the KV pool is small so
that several test servers fit in memory), under the loads a first benchmark sends: nothing is
refused, nothing fails, and the same greedy request gives the same text streamed or not."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from conftest import DEFAULT_SERVER

from tandem.ops import extension

pytestmark = pytest.mark.slow

WORDS = ["the", "sea", "ships", "sail", "under", "a", "grey", "sky", "while", "gulls", "call", "over", "harbour",
         "walls", "and", "old", "ropes", "creak"]


def text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * (seed % 5 + 1)) % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def server(shared_server):  # noqa: ANN001, ANN201
    return shared_server(*DEFAULT_SERVER)


async def _post(c: httpx.AsyncClient, url: str, body: dict) -> httpx.Response:
    return await c.post(f"{url}/v1/completions", json=body)


def _all_served(responses: list[httpx.Response]) -> None:
    assert [r.status_code for r in responses] == [200] * len(responses), \
        [r.text for r in responses if r.status_code != 200][:3]
    for r in responses:
        assert r.json()["choices"][0]["finish_reason"] == "length"


def test_a_burst_at_concurrency_32_is_served_whole(server) -> None:  # noqa: ANN001
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=32)) as c:
            return await asyncio.gather(*(_post(c, server.url, {
                "prompt": f"{i}: {text(100, i)}", "max_tokens": 32, "ignore_eos": True, "temperature": 0})
                for i in range(32)))

    before = server.metric("request_rejected_total")
    _all_served(asyncio.run(run()))
    assert server.metric("request_rejected_total") == before


def test_a_shared_prefix_at_concurrency_2_is_served_whole(server) -> None:  # noqa: ANN001
    prefix = text(900, 3)  # about 1,000 tokens, cached after the first request

    async def run() -> list[httpx.Response]:
        out: list[httpx.Response] = []
        async with httpx.AsyncClient(timeout=300) as c:
            for i in range(0, 12, 2):
                out += await asyncio.gather(*(_post(c, server.url, {
                    "prompt": f"{prefix} Question {j}: why?", "max_tokens": 16, "ignore_eos": True})
                    for j in (i, i + 1)))
        return out

    before = server.metric("request_rejected_total")
    _all_served(asyncio.run(run()))
    assert server.metric("request_rejected_total") == before
    assert server.metric("prefix_cache_hits_total") > 0


def test_a_long_short_mix_at_2_requests_a_second_is_served_whole(server) -> None:  # noqa: ANN001
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = []
            for i in range(16):
                words = 1200 if i % 4 == 0 else 30
                tasks.append(asyncio.create_task(_post(c, server.url, {
                    "prompt": f"{i} {text(words, 100 + i)}", "max_tokens": 16, "ignore_eos": True})))
                await asyncio.sleep(0.5)
            return list(await asyncio.gather(*tasks))

    before = server.metric("request_rejected_total")
    _all_served(asyncio.run(run()))
    assert server.metric("request_rejected_total") == before


@pytest.mark.skipif(extension.extension_isa() != "avx512-bf16",
                    reason="batch invariance is the AVX512-BF16 build's (tests/test_batch_invariance.py)")
def test_the_same_greedy_request_gives_the_same_text_streamed_or_not(server) -> None:  # noqa: ANN001
    """Eight chats of 128 tokens, each sent streamed and not, all sixteen at once: the same text
    and the same logprobs, bit for bit (the second of a pair also hits the prefix cache)."""
    async def one(c: httpx.AsyncClient, i: int, stream: bool) -> tuple[str, list[float]]:
        body = {"messages": [{"role": "user", "content": f"Tell me a story about {WORDS[i]}."}],
                "max_tokens": 128, "temperature": 0, "logprobs": True, "stream": stream, "ignore_eos": True}
        if not stream:
            r = await c.post(f"{server.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"], [t["logprob"] for t in choice["logprobs"]["content"]]
        content, logprobs = "", []
        async with c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:])["choices"]:
                    content += choice["delta"].get("content") or ""
                    logprobs += [t["logprob"] for t in (choice.get("logprobs") or {}).get("content") or []]
        return content, logprobs

    async def run() -> list[tuple[str, list[float]]]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=16)) as c:
            return await asyncio.gather(*(one(c, i // 2, i % 2 == 1) for i in range(16)))

    t0 = time.monotonic()
    results = asyncio.run(run())
    for i in range(0, 16, 2):
        plain, streamed = results[i], results[i + 1]
        assert len(plain[1]) == 128
        assert streamed == plain, f"prompt {i // 2} differs streamed ({time.monotonic() - t0:.0f} s)"
