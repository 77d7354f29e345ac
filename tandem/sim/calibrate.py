"""The serving path's share of a step: the same engine behind `tandem serve` (its API process, or a
router, on the same cores), timed from the client. Decode batches of a few sizes and single prompts
of a few lengths give (predicted engine step, sequences, measured) points; the fit
measured = scale·predicted + overhead + per_seq·sequences is what the simulator adds to every step."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

from tandem.bench.client import EndpointConfig, RequestRecord, send_request
from tandem.bench.workloads import TextMaker, Tokenizer
from tandem.sim.cost import FittedCost, StepShape, nnls

DECODE_BATCHES = (1, 4, 16)
PROMPT_LENS = (32, 256, 768)
PROMPT_TOKENS = 128
OUTPUT_TOKENS = 40
SKIP = 8  # a batch's first gaps still share steps with its prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _batch(cfg: EndpointConfig, prompts: list[str], max_tokens: int) -> list[RequestRecord]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600)) as http:
        records = [RequestRecord(i, i, 0, "calibrate", 0, max_tokens) for i in range(len(prompts))]
        origin = time.perf_counter()
        await asyncio.gather(*(send_request(http, cfg, p, r, origin, lambda t: 0)
                               for p, r in zip(prompts, records, strict=True)))
    failed = [r for r in records if not r.success]
    if failed:
        raise RuntimeError(f"calibration request failed: {failed[0].error}")
    return records


def serving_points(url: str, cost: FittedCost, tokenizer: Tokenizer, progress: Callable[[str], None],
                   batches: tuple[int, ...] = DECODE_BATCHES, prompt_lens: tuple[int, ...] = PROMPT_LENS,
                   seed: int = 0) -> list[tuple[float, int, float]]:
    maker = TextMaker(tokenizer)
    rng = np.random.default_rng(seed)
    from tandem.bench.serve import fetch_model_id

    cfg = EndpointConfig(url, "/v1/completions", fetch_model_id(url, None), ignore_eos=True)
    asyncio.run(_batch(cfg, [maker.text(rng, 16)], 4))  # warm-up
    points = []
    for batch in batches:
        progress(f"serving: {batch} streams")
        records = asyncio.run(_batch(cfg, [maker.text(rng, PROMPT_TOKENS) for _ in range(batch)], OUTPUT_TOKENS))
        gaps = [g for r in records for g in r.itl[SKIP:]]
        context = PROMPT_TOKENS + (SKIP + OUTPUT_TOKENS) // 2
        predicted = cost.step_time(StepShape.of([(1, context, True)] * batch), serving=False)
        points.append((predicted, batch, float(np.median(gaps))))
    for n in prompt_lens:
        progress(f"serving: a prompt of {n} tokens")
        ttfts = [asyncio.run(_batch(cfg, [maker.text(rng, n)], 1))[0].ttft for _ in range(3)]
        predicted = cost.step_time(StepShape.of([(n, 0, True)]), serving=False)
        points.append((predicted, 1, float(np.median(ttfts))))
    return points


def fit_serving(points: list[tuple[float, int, float]]) -> list[float]:
    """[scale, overhead_s, per_seq_s], non-negative, least relative error."""
    a = np.asarray([[p, 1.0, b] for p, b, _ in points])
    y = np.asarray([m for _, _, m in points])
    w = 1.0 / y
    scale = np.maximum(np.abs(a * w[:, None]).max(axis=0), 1e-30)
    return (nnls(a * w[:, None] / scale, y * w) / scale).tolist()


def calibrate(cost: FittedCost, serve_argv: list[str], tokenizer: Tokenizer, log_path: Path,
              progress: Callable[[str], None], batches: tuple[int, ...] = DECODE_BATCHES,
              prompt_lens: tuple[int, ...] = PROMPT_LENS, timeout_s: float = 300.0) -> list[tuple[float, int, float]]:
    """Start `tandem serve` with serve_argv on a free loopback port, measure, stop it."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    progress(f"serving: starting tandem serve {' '.join(serve_argv)}")
    # The server places its own processes (a worker pins itself): it may use every core, whatever
    # this process was pinned to while it measured.
    pinned = os.sched_getaffinity(0)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    try:
        with log_path.open("w") as log:
            # Admission off: the calibration times the batches it sends; a slow machine's server would
            # refuse some of them against its default SLOs.
            proc = subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", "--port", str(port), *serve_argv,
                                     "--admission", "off"],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    finally:
        os.sched_setaffinity(0, pinned)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited with {proc.returncode}; see {log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"tandem serve did not become healthy in {timeout_s:.0f} s; see {log_path}")
            time.sleep(0.5)
        return serving_points(url, cost, tokenizer, progress, batches, prompt_lens)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
