"""Local workers that die are started again, with a backoff that doubles while they keep dying young."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from tandem.disagg.registry import WorkerHandle

log = logging.getLogger(__name__)

YOUNG_S = 60.0  # a worker that dies sooner after joining than this doubles its next delay


class Restarter:
    def __init__(self, start: Callable[[str], None], backoff_s: float, max_backoff_s: float) -> None:
        self.start = start  # worker id -> its process started again (the fleet's start)
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.count = 0
        self._deaths: dict[str, int] = {}  # worker id -> deaths in a row, each young
        self._tasks: set[asyncio.Task] = set()
        self._stopped = False

    def schedule(self, worker: WorkerHandle) -> bool:
        """Start the worker again later; False if it is not ours to start: a remote worker is restarted
        by its own host and joins again."""
        if not worker.local or self._stopped:
            return False
        young = time.monotonic() - worker.joined < YOUNG_S
        deaths = self._deaths.get(worker.worker_id, -1) + 1 if young else 0
        self._deaths[worker.worker_id] = deaths
        delay = min(self.backoff_s * 2 ** deaths, self.max_backoff_s)
        log.warning("starting worker %s again in %.0f s", worker.worker_id, delay)

        async def restart() -> None:
            await asyncio.sleep(delay)
            if not self._stopped:
                self.start(worker.worker_id)
                self.count += 1

        task = asyncio.get_running_loop().create_task(restart())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def stop(self) -> None:
        self._stopped = True
        for task in self._tasks:
            task.cancel()
