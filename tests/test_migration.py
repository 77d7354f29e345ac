"""Live migration end to end: a stream moved mid-generation from one colocated worker to the other,
KV and all, over shared memory and over TCP, goes on without a gap the client sees and gives the
offline engine's greedy and seeded output; both pools end with every block free."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from cluster_utils import metric, wait_blocks_free
from server_utils import Server, running_server, web

from tandem import SamplingParams

pytestmark = pytest.mark.slow

# Two colocated workers of one core each (round-robin over this process's cores); a small budget chunks the
# prompt (several blocks, a partial last one).
PAIR = ("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-batched-tokens", "64", "--workers", "2")
MAX_TOKENS = 64
MOVE_AFTER = 8  # streamed chunks before the move


def in_flight(server: Server) -> dict[str, int]:
    workers = web.get(f"{server.url}/v1/cluster", timeout=10).json()["workers"]
    return {w["id"]: w["in_flight"] for w in workers}


def stream_and_move(server: Server, prompt: str, params: dict) -> tuple[str, dict, list[float]]:
    """Stream a completion; after MOVE_AFTER chunks, move its worker's requests. Returns the text,
    the migrate call's answer and the gaps between chunks."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, **params}
    text, stamps, answer = [], [], {}
    with web.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            stamps.append(time.monotonic())
            if len(text) == MOVE_AFTER:
                [busy] = [w for w, n in in_flight(server).items() if n]
                moved = web.post(f"{server.url}/v1/cluster/workers/{busy}/migrate", timeout=60)
                assert moved.status_code == 200, moved.text
                answer = moved.json()
                answer["from"] = busy
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return "".join(text), answer, gaps


@pytest.fixture(scope="module", params=["shm", "zmq"])
def pair(request: pytest.FixtureRequest) -> Server:  # noqa: ANN201 (a generator fixture)
    with running_server(*PAIR, "--kv-transport", request.param) as s:
        s.transport = request.param  # type: ignore[attr-defined]
        yield s


def test_a_stream_moved_mid_generation_gives_the_offline_output(pair: Server, llm_fp32, passages: list[str]) -> None:  # noqa: ANN001
    prompt = " ".join(passages)[:600]
    cases = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.8, "seed": 11}}
    offline = {name: llm_fp32.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **p),
                                       use_tqdm=False)[0].outputs[0].text for name, p in cases.items()}
    s = pair
    before = metric(s, "router_migrations")
    for i, (name, params) in enumerate(cases.items()):
        text, answer, gaps = stream_and_move(s, prompt, params)
        assert len(answer["migrated"]) == 1 and not answer["not_migrated"], answer
        assert text == offline[name], name
        assert metric(s, "router_migrations") == before + i + 1
        # The stream went on: no gap near a request's own length (a restart would be one).
        assert max(gaps) < 5.0
    # The KV went from one worker's pool to the other's.
    transfers = web.get(f"{s.url}/v1/cluster", timeout=10).json()["transfers"]
    assert sum(t["bytes"] for t in transfers) > 0
    wait_blocks_free(s)


def test_moving_what_cannot_move_says_why_and_serves_on(pair: Server, passages: list[str]) -> None:
    """An unknown worker is a 404; a worker with nothing decoding moves nothing; one whose only
    request is still in its prompt keeps it, and the request completes."""
    if pair.transport != "shm":  # type: ignore[attr-defined]
        pytest.skip("the router's side: the same over either transport")
    s = pair
    r = web.post(f"{s.url}/v1/cluster/workers/nobody/migrate", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    idle = next(iter(in_flight(s)))
    r = web.post(f"{s.url}/v1/cluster/workers/{idle}/migrate", timeout=10)
    assert r.status_code == 200 and r.json()["migrated"] == [] and r.json()["not_migrated"] == {}
    # A long prompt at 64 tokens a step: moved while prefilling, nothing has streamed yet.
    long = " ".join(passages)[:3000]
    done: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: done.update(r=web.post(
        f"{s.url}/v1/completions", json={"prompt": long, "max_tokens": 4, "temperature": 0}, timeout=120)))
    t.start()
    deadline = time.monotonic() + 30
    while not any(in_flight(s).values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    [busy] = [w for w, n in in_flight(s).items() if n]
    r = web.post(f"{s.url}/v1/cluster/workers/{busy}/migrate", timeout=30)
    assert r.status_code == 200 and r.json()["migrated"] == []
    t.join(120)
    assert done["r"].status_code == 200 and done["r"].json()["choices"][0]["finish_reason"] == "length"
    wait_blocks_free(s)
