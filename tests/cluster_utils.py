"""Helpers for tests that run a server with a cluster behind it: its metrics, its workers, a set of
prompts sent at once."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Callable

import httpx
import openai
from server_utils import Server, web
from tiny_served_model import tiny_served_model

# A small token budget forces chunked prefill (and so multi-step, layer-wise transfers).
COMMON = ("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-batched-tokens", "64")
# The same on a tiny random model (3 KV heads, as the default model has): for the protocols' tests.
TINY = (str(tiny_served_model()), *COMMON)


def metric(server: Server, name: str, **labels: str) -> float:
    """Sum of a metric's samples whose labels include the given ones."""
    total, found = 0.0, False
    for line in web.get(f"{server.url}/metrics", timeout=5).text.splitlines():
        if not line.startswith(f"tandem:{name}"):
            continue
        series, value = line.rsplit(" ", 1)
        if series.split("{")[0] not in (f"tandem:{name}", f"tandem:{name}_total"):  # counters end in _total
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(name)
    return total


def wait_blocks_free(server: Server, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _used_on_live_workers(server) == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"blocks still allocated on live workers: {_used_on_live_workers(server)}")


def _used_on_live_workers(server: Server) -> float:
    text = web.get(f"{server.url}/metrics", timeout=5).text
    up = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
          for line in text.splitlines() if line.startswith("tandem:worker_up{")}
    used = 0.0
    for line in text.splitlines():
        if line.startswith("tandem:worker_kv_cache_used_blocks{"):
            labels = line.split("{")[1].split("}")[0]
            if up.get(labels, 0) == 1:
                used += float(line.rsplit(" ", 1)[1])
    return used


def worker_pid(server: Server, worker_id: str) -> int:
    out = subprocess.run(["pgrep", "-P", str(server.proc.pid), "-f", f"worker-id {worker_id}"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert len(out) == 1, out
    return int(out[0])


def prompts(passages: list[str]) -> list[str]:
    long = " ".join(passages)[:2500]  # several hundred tokens: many chunks and blocks
    return [
        "Hi",
        "The capital of France is",
        "List the planets of the solar system in order:",
        long,
        long + " To sum up,",  # shares the long prefix: prefix-cache hits on both sides
        passages[0],
    ]


def run_all(server: Server, texts: list[str], max_tokens: int = 24, **extra: object) -> list[tuple[str, str]]:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id

    async def one(c: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
        r = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, **{"temperature": 0, **extra})
        return r.choices[0].text, r.choices[0].finish_reason

    async def main() -> list[tuple[str, str]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
            return list(await asyncio.gather(*(one(c, p) for p in texts)))

    return asyncio.run(main())


def metric_or_zero(server: Server, name: str, **labels: str) -> float:
    """For series that appear only once something happened."""
    try:
        return metric(server, name, **labels)
    except (KeyError, httpx.HTTPError):
        return 0.0


def settled(read: Callable[[], object], until: Callable[[object], bool], timeout: float = 10) -> object:
    """read() once until(value) holds, within timeout (else its last value): workers report their
    counters every so often, so a metric catches up with a request shortly after its response."""
    deadline = time.monotonic() + timeout
    value = read()
    while not until(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value
