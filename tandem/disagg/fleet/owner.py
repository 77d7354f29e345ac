"""The one owner of the worker processes the router started (through its launcher, launcher.py).

The router starts them here, the registry asks here whether a joining worker is one of them and
whether its process has exited, the restarter starts a dead one again here, and the planner moves
cores between pools, adds and releases workers here. A router without a launcher owns none: every
worker is remote, started (and restarted) by its own host.
"""

from __future__ import annotations

import asyncio
import subprocess

from tandem.disagg.fleet.launcher import Launcher, WorkerProcess, WorkerSpec


class WorkerFleet:
    def __init__(self, launcher: Launcher | None) -> None:
        self.launcher = launcher
        self.address = ""  # the router's, set by start_all: where every (re)started worker connects
        # Every process ever started, the replaced ones too: a worker declared dead because it went
        # silent may still run, and shutdown must not leave it behind. A worker's process is found by
        # the pid it registers with.
        self._started: list[WorkerProcess] = []

    @property
    def launches(self) -> bool:
        """It can start workers (a launcher was given)."""
        return self.launcher is not None

    @property
    def elastic(self) -> bool:
        return self.launcher is not None and self.launcher.elastic

    def can_grow(self) -> bool:
        return self.elastic and self._need().can_grow()

    def spec(self, worker_id: str) -> WorkerSpec:
        return self._need().spec(worker_id)

    # -- starting -----------------------------------------------------------------------------
    def start_all(self, address: str) -> int:
        """Start the launcher's workers, connecting to the router at address; how many (0 without a launcher)."""
        self.address = address
        if self.launcher is None:
            return 0
        procs = self.launcher.start_all(address)
        self._started.extend(procs.values())
        return len(procs)

    def start(self, worker_id: str) -> None:
        """Start the worker (again, after a death): same id, role and cores."""
        self._started.append(self._need().start(worker_id, self.address))

    def change_role(self, worker_id: str, role: str) -> str:
        """A stopped worker's cores to a new worker of the role, started; its id."""
        new_id = self._need().change_role(worker_id, role)
        self.start(new_id)
        return new_id

    def add(self, role: str) -> str:
        """Elastic: a worker more of the role on new cores, started; its id."""
        new_id = self._need().add(role)
        self.start(new_id)
        return new_id

    def release(self, worker_id: str) -> None:
        """A stopped worker leaves the roster; its cores are free."""
        self._need().release(worker_id)

    # -- watching -----------------------------------------------------------------------------
    def owns(self, pid: int) -> bool:
        """The worker registering with this pid runs in a process this router started."""
        return self._process(pid) is not None

    def exit_code(self, pid: int) -> int | None:
        """The exit code of our process with this pid; None while it runs, or if it is not ours."""
        proc = self._process(pid)
        return proc.poll() if proc is not None else None

    def start_up_exits(self) -> list[int | None] | None:
        """Exit codes of every process started, if any of them exited (a start-up failure); None if none."""
        codes = [p.poll() for p in self._started]
        return codes if any(c is not None for c in codes) else None

    def starting(self, known_pids: set[int]) -> bool:
        """A process of ours runs that no worker has registered from (known_pids: every worker the router
        knows, dead ones too): one started again, on its way to join."""
        return any(p.poll() is None and p.pid not in known_pids for p in self._started)

    async def wait(self, pid: int, timeout: float) -> None:
        """Until our process with this pid exits; subprocess.TimeoutExpired after timeout seconds."""
        proc = self._process(pid)
        if proc is not None:
            await asyncio.get_running_loop().run_in_executor(None, proc.wait, timeout)

    # -- stopping -----------------------------------------------------------------------------
    def kill_all(self) -> None:
        for p in self._started:
            p.kill()

    async def wait_all(self, timeout: float, told: set[int]) -> None:
        """The processes asked to stop (told: their pids) get timeout seconds each to exit, then are
        killed; any other still running (one starting, never registered) is killed at once."""
        loop = asyncio.get_running_loop()
        for p in self._started:
            if p.pid not in told and p.poll() is None:
                p.kill()
            try:
                await loop.run_in_executor(None, p.wait, timeout)
            except subprocess.TimeoutExpired:
                p.kill()

    def _process(self, pid: int) -> WorkerProcess | None:
        return next((p for p in reversed(self._started) if p.pid == pid), None)  # the latest: pids get reused

    def _need(self) -> Launcher:
        if self.launcher is None:
            raise RuntimeError("this router starts no workers (no launcher)")
        return self.launcher
