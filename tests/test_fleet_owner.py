"""The owner of a router's worker processes (disagg/fleet/owner.py) at shutdown: the workers told to
stop get their grace period; a process still starting (a worker started again, not yet joined, so
never told) goes at once rather than holding the server's exit for the whole grace period."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass, field

from tandem.disagg.fleet.launcher import Roster, WorkerSpec
from tandem.disagg.fleet.owner import WorkerFleet


@dataclass
class FakeProcess:
    """A process that runs until its returncode is set (it exited) or it is killed; wait() times out
    while it runs."""

    pid: int
    returncode: int | None = None
    killed: bool = False

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or 0)
        while self.returncode is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("fake", timeout or 0)
            time.sleep(0.01)
        return self.returncode

    def kill(self) -> None:
        self.killed, self.returncode = True, -9


@dataclass
class FakeLauncher(Roster):
    procs: dict[str, FakeProcess] = field(default_factory=dict)

    def start(self, worker_id: str, router_address: str) -> FakeProcess:
        return self.procs[worker_id]


def test_a_process_never_told_to_stop_is_killed_at_once_and_the_told_ones_exit_by_themselves() -> None:
    joined = FakeProcess(101)
    starting = FakeProcess(102)  # started again, not yet registered
    launcher = FakeLauncher({"colocated-0": WorkerSpec("colocated", [0]), "colocated-1": WorkerSpec("colocated", [1])},
                            {"colocated-0": joined, "colocated-1": starting})
    fleet = WorkerFleet(launcher)
    fleet.start_all("tcp://127.0.0.1:1")
    joined.returncode = 0  # it got Shutdown and exited

    t0 = time.monotonic()
    asyncio.run(fleet.wait_all(5.0, told={joined.pid}))
    assert time.monotonic() - t0 < 2.5, "the starting process held the shutdown for its grace period"
    assert starting.killed and starting.poll() is not None
    assert not joined.killed and joined.poll() == 0


def test_a_told_process_that_does_not_exit_is_killed_after_its_grace_period() -> None:
    stuck = FakeProcess(201)
    launcher = FakeLauncher({"decode-0": WorkerSpec("decode", [0])}, {"decode-0": stuck})
    fleet = WorkerFleet(launcher)
    fleet.start_all("tcp://127.0.0.1:1")
    t0 = time.monotonic()
    asyncio.run(fleet.wait_all(0.3, told={stuck.pid}))
    assert time.monotonic() - t0 >= 0.3 and stuck.killed
