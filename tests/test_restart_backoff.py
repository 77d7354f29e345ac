"""One restart backoff for every worker the router starts (the single server's one included: it is a
cluster of one), on a fake clock: the first wait 1 s, doubling per death within a minute of joining,
capped at 30 s, back to 1 s after a minute alive; the router's Restarter follows it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import cast

from fake_clock import Clock

from tandem.disagg.fleet.restarts import Restarter
from tandem.disagg.router.registry import WorkerHandle
from tandem.disagg.router.settings import RouterSettings
from tandem.restart_backoff import MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S, RestartBackoff

# How long each start of the process lives; then the delays the rule gives after each death.
LIFETIMES = [0, 0, 0, 0, 0, 0, 0, 61, 0, 59]
DELAYS = [1, 2, 4, 8, 16, 30, 30, 1, 2, 4]  # 61 s alive resets; 59 s is still a quick death


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


def test_the_routers_default_is_the_rule() -> None:
    settings, rule = RouterSettings(), RestartBackoff()
    assert (settings.restart_backoff_s, settings.max_restart_backoff_s) == (rule.initial_s, rule.max_s)


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
