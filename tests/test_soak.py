"""A soak of a few thousand requests of varied sizes with random aborts and disconnects, over a real
server (a tiny random model, so the run is about the server, not the matmuls): no KV block leaks
and the engine process's memory stays flat after warm-up."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import pytest
import torch
from server_utils import children, running_server, web
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512
NUM_REQUESTS = 2400
WARM_UP = 400


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "llama"
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def engine_rss_kib(server_pid: int) -> int:
    """Resident memory of the engine: the server's one worker process, running the model."""
    rss = 0
    for pid in children(server_pid):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"--role\x00colocated" in cmdline:  # its lone worker (the template sandbox runs no model)
            rss = max(rss, int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS"))))
    assert rss, "no engine process found"
    return rss


async def one(c: httpx.AsyncClient, url: str, rng: random.Random) -> str:
    body = {"prompt": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 400))],
            "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.8]), "ignore_eos": True}
    fate = rng.random()
    try:
        if fate < 0.15:  # a client that hangs up before the answer
            await c.post(f"{url}/v1/completions", json=body, timeout=rng.uniform(0.001, 0.05))
            return "done"
        if fate < 0.3:  # a stream abandoned after a few chunks
            async with c.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
                async for _ in r.aiter_lines():
                    if rng.random() < 0.3:
                        break
            return "aborted"
        r = await c.post(f"{url}/v1/completions", json=body | {"stream": fate < 0.6}, timeout=60)
        return "server_error" if r.status_code >= 500 else "done"
    except httpx.TimeoutException:
        return "disconnected"


async def soak(url: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(24)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64)) as c:
        async def bounded() -> str:
            async with sem:
                return await one(c, url, rng)

        return await asyncio.gather(*(bounded() for _ in range(n)))


def metric(url: str, name: str) -> float:
    for line in web.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"tandem:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


@pytest.mark.slow
def test_soak_leaks_no_blocks_and_memory_stays_flat(tiny_model: Path) -> None:
    with running_server(str(tiny_model), "--dtype", "float32", "--num-blocks", "2048", "--max-num-seqs", "32",
                        "--max-num-batched-tokens", "512") as s:
        outcomes = asyncio.run(soak(s.url, WARM_UP, 1))
        before = engine_rss_kib(s.proc.pid)
        outcomes += asyncio.run(soak(s.url, NUM_REQUESTS - WARM_UP, 2))
        assert "server_error" not in outcomes
        assert outcomes.count("aborted") + outcomes.count("disconnected") > NUM_REQUESTS // 10
        deadline = time.monotonic() + 30  # the last aborts land at the next step boundary
        while metric(s.url, "kv_cache_used_blocks") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert metric(s.url, "kv_cache_used_blocks") == 0, "KV blocks leaked"
        assert metric(s.url, "num_requests_running") == 0
        after = engine_rss_kib(s.proc.pid)
        print(f"engine RSS after warm-up {before} KiB, after the soak {after} KiB")
        assert after < before * 1.05, f"engine RSS grew {before} -> {after} KiB"
