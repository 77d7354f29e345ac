"""One restart backoff for the engine core and for cluster workers, on a fake clock: the first wait
1 s, doubling per death within a minute of starting, capped at 30 s, back to 1 s after a minute
alive; the core's watchdog and the router's Restarter both follow it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

import pytest
from fake_clock import Clock

from tandem.config import EngineConfig
from tandem.disagg.fleet.restarts import Restarter
from tandem.disagg.router.registry import WorkerHandle
from tandem.disagg.router.settings import RouterSettings
from tandem.restart_backoff import MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S, RestartBackoff
from tandem.serve.async_engine import AsyncEngine

# How long each start of the process lives; then the delays the rule gives after each death.
LIFETIMES = [0, 0, 0, 0, 0, 0, 0, 61, 0, 59]
DELAYS = [1, 2, 4, 8, 16, 30, 30, 1, 2, 4]  # 61 s alive resets; 59 s is still a quick death


class Done(Exception):
    pass


def test_the_rule() -> None:
    clock = Clock()
    backoff = RestartBackoff(clock=clock)
    delays = []
    for life in LIFETIMES:
        started = clock.now
        clock.now += life + 0.1  # noticed a moment after it died
        delays.append(backoff.next_delay(started))
        clock.now += delays[-1]
    assert delays == DELAYS
    assert (RESTART_BACKOFF_S, MAX_RESTART_BACKOFF_S) == (1.0, 30.0)


def test_one_default_for_the_core_and_the_workers() -> None:
    settings, core = RouterSettings(), RestartBackoff()
    assert (settings.restart_backoff_s, settings.max_restart_backoff_s) == (core.initial_s, core.max_s)


def test_the_core_watchdog_follows_it() -> None:
    """AsyncEngine._watch_process with a fake core process that lives LIFETIMES[i] after its i-th start."""
    clock = Clock()
    engine = AsyncEngine(EngineConfig(), None)
    engine.restart_backoff = RestartBackoff(clock=clock)
    lifetimes = iter(LIFETIMES)
    waits: list[float] = []

    def spawn() -> None:
        try:
            life = next(lifetimes)
        except StopIteration:
            raise Done from None
        dies_at = clock.now + life
        engine._proc = cast(object, SimpleNamespace(is_alive=lambda: clock.now < dies_at, exitcode=1))
        engine._started_at = clock()

    async def sleep(s: float) -> None:
        waits.append(s)
        clock.now += s

    engine._spawn = spawn  # type: ignore[method-assign]
    try:
        spawn()
        with pytest.raises(Done):
            asyncio.run(engine._watch_process(sleep))
    finally:
        engine._ctx.term()
        engine._tmp.cleanup()
    assert [w for w in waits if w != 0.5] == DELAYS  # the rest: the watchdog's polls


def test_the_restarter_follows_it() -> None:
    """A local worker that keeps dying LIFETIMES[i] after it joined, as the router sees it."""
    clock = Clock()
    waits: list[float] = []
    worker = WorkerHandle(cast(object, SimpleNamespace(worker_id="decode-0")), b"", local=True, joined=0.0)

    async def sleep(s: float) -> None:
        waits.append(s)
        clock.now += s

    def start(worker_id: str) -> None:
        assert worker_id == "decode-0"
        worker.joined = clock()

    async def main() -> None:
        restarter = Restarter(start, clock=clock, sleep=sleep)
        for life in LIFETIMES:
            clock.now = worker.joined + life + 0.1
            assert restarter.schedule(worker)
            await asyncio.gather(*restarter._tasks)
        assert restarter.count == len(LIFETIMES)
        # A remote worker is its own host's to restart.
        assert not restarter.schedule(WorkerHandle(worker.info, b"", local=False))

    asyncio.run(main())
    assert waits == DELAYS
