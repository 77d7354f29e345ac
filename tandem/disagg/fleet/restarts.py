"""Local workers that die are started again, with the restart backoff (tandem/restart_backoff.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from tandem.restart_backoff import MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S, RestartBackoff

log = logging.getLogger(__name__)


class DeadWorker(Protocol):
    """What a restart reads of a worker that died (a registry entry)."""

    worker_id: str
    local: bool  # started by this router's launcher (a remote worker's host restarts it)
    joined: float  # when it last joined, on the restarter's clock


class Restarter:
    def __init__(self, start: Callable[[str], None], backoff_s: float = RESTART_BACKOFF_S,
                 max_backoff_s: float = MAX_RESTART_BACKOFF_S, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[object]] = asyncio.sleep) -> None:
        self.start = start  # worker id -> its process started again (the fleet's start)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.clock, self.sleep = clock, sleep  # the registry's clock (a worker's joined time is on it)
        self.count = 0
        self._backoffs: dict[str, RestartBackoff] = {}  # per worker id: a restarted worker keeps its id
        self._tasks: set[asyncio.Task] = set()
        self._stopped = False

    def schedule(self, worker: DeadWorker) -> bool:
        """Start the worker again later; False if it is not ours to start: a remote worker is restarted
        by its own host and joins again."""
        if not worker.local or self._stopped:
            return False
        backoff = self._backoffs.setdefault(worker.worker_id,
                                            RestartBackoff(self.backoff_s, self.max_backoff_s, clock=self.clock))
        delay = backoff.next_delay(worker.joined)
        log.warning("starting worker %s again in %.0f s", worker.worker_id, delay)

        async def restart() -> None:
            await self.sleep(delay)
            if not self._stopped:
                self.start(worker.worker_id)
                self.count += 1

        task = asyncio.get_running_loop().create_task(restart())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def pending(self) -> bool:
        """A restart is scheduled and has not started the process yet."""
        return bool(self._tasks)

    def stop(self) -> None:
        self._stopped = True
        for task in self._tasks:
            task.cancel()
