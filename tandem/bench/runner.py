"""The load loop: sessions start on the arrival schedule, capped by a concurrency limit."""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.bench.arrivals import session_offsets
from tandem.bench.client import EndpointConfig, RequestRecord, send_request
from tandem.bench.workloads import Session, num_requests


@dataclass
class RunConfig:
    endpoint: EndpointConfig
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    request_timeout: float | None = 600.0  # seconds without a byte before a request counts as failed
    progress: bool = True
    # Mean seconds a user takes before the next turn of a conversation (exponential; 0: at once). Real
    # users think: meanwhile other conversations' requests land, as they do on a shared deployment.
    think_time_s: float = 0.0


@dataclass
class RunResult:
    records: list[RequestRecord]
    duration: float  # first send to the last request's end, seconds


class _Bar:
    """A rich progress bar on stderr (stdout keeps only the results), or nothing."""

    def __init__(self, total: int, enabled: bool, label: str) -> None:
        self.progress = Progress(TextColumn(f"[bold]{label}[/]"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("{task.fields[failed]} failed"),
                                 console=Console(stderr=True), disable=not enabled, transient=False)
        self.task = self.progress.add_task(label, total=total, failed=0)
        self.failed = 0

    def __enter__(self) -> _Bar:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def done(self, record: RequestRecord) -> None:
        self.failed += not record.success
        self.progress.update(self.task, advance=1, failed=self.failed)


async def _run_session(http: httpx.AsyncClient, cfg: EndpointConfig, session: Session, session_index: int,
                       first_index: int, start_at: float, origin: float, gate: asyncio.Semaphore | None,
                       count_tokens: Callable[[str], int], bar: _Bar, think: Callable[[], float]
                       ) -> list[RequestRecord]:
    delay = start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    records: list[RequestRecord] = []
    history: list[dict[str, str]] = []
    history_tokens = 0
    failed = False
    for t, turn in enumerate(session.turns):
        record = RequestRecord(first_index + t, session_index, t, turn.category, history_tokens + turn.prompt_len,
                               turn.expected_output_len)
        records.append(record)
        if failed:
            # A conversation cannot go on without the reply it builds on.
            record.start = time.perf_counter() - origin
            record.error = "an earlier turn of this conversation failed"
            bar.done(record)
            continue
        messages = [*history, {"role": "user", "content": turn.prompt}]
        if t:
            await asyncio.sleep(think())
        if gate is None:
            await send_request(http, cfg, messages, record, origin, count_tokens)
        else:
            async with gate:
                await send_request(http, cfg, messages, record, origin, count_tokens)
        bar.done(record)
        failed = not record.success
        history = [*messages, {"role": "assistant", "content": record.generated_text}]
        history_tokens = record.prompt_len + record.output_tokens
    return records


def session_thinker(think_time_s: float, seed: int, session_index: int) -> Callable[[], float]:
    """The session's think times: seeded by the run's seed and the session, so reruns repeat them."""
    if think_time_s <= 0:
        return lambda: 0.0
    rng = np.random.default_rng([seed, session_index])
    return lambda: float(rng.exponential(think_time_s))


def _client(cfg: RunConfig) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency)
    return httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout), limits=limits)


async def run_sessions(cfg: RunConfig, sessions: list[Session], count_tokens: Callable[[str], int],
                       label: str = "requests") -> RunResult:
    offsets = session_offsets(sessions, cfg.request_rate, cfg.burstiness, cfg.seed)
    gate = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    firsts = [0]
    for s in sessions:
        firsts.append(firsts[-1] + len(s.turns))
    enabled = cfg.progress and sys.stderr.isatty()
    async with _client(cfg) as http:
        with _Bar(num_requests(sessions), enabled, label) as bar:
            origin = time.perf_counter()
            tasks = [asyncio.create_task(_run_session(http, cfg.endpoint, s, i, firsts[i], origin + off, origin,
                                                      gate, count_tokens, bar,
                                                      session_thinker(cfg.think_time_s, cfg.seed, i)))
                     for i, (s, off) in enumerate(zip(sessions, offsets, strict=True))]
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - origin
    records = sorted((r for rs in results for r in rs), key=lambda r: r.index)
    return RunResult(records, duration)


def run(cfg: RunConfig, sessions: list[Session], count_tokens: Callable[[str], int],
        warmups: list[Session] | None = None) -> RunResult:
    """Warm-up sessions first (results dropped), then the measured run."""
    if warmups:
        warm_cfg = RunConfig(cfg.endpoint, math.inf, 1.0, cfg.max_concurrency, cfg.seed, cfg.request_timeout,
                             cfg.progress)
        warm = asyncio.run(run_sessions(warm_cfg, warmups, count_tokens, label="warm-up"))
        failed = [r for r in warm.records if not r.success]
        if failed:
            print(f"warning: {len(failed)} of {len(warm.records)} warm-up requests failed: {failed[0].error}",
                  file=sys.stderr)
    return asyncio.run(run_sessions(cfg, sessions, count_tokens))
