"""The launcher interface: how the router starts the workers it owns, on this host (local_launcher.py) or
as Ray actors (ray_launcher.py).

A launcher holds the deployment's roster: each worker's id ("decode-0") and WorkerSpec (its role
and cores). It starts a worker's process from its spec, again with the same id after a death, and
edits the roster when the planner moves cores from one pool to another or, where the launcher is
elastic, adds a worker on new cores or lets one go. It does not keep the processes it starts:
the router's WorkerFleet (owner.py) owns them, and it is the launcher's only caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol


@dataclass
class WorkerSpec:
    role: str  # prefill, decode or colocated
    cores: list[int]  # local: the CPU cores it is pinned to; Ray: as many entries as CPUs it reserves


class WorkerProcess(Protocol):
    """A started worker, as the router watches it (subprocess.Popen has this face; a Ray actor is given it)."""

    pid: int

    def poll(self) -> int | None:
        """Its exit code, None while it runs."""

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code once it exits; subprocess.TimeoutExpired after timeout seconds."""

    def kill(self) -> None: ...


class Launcher(Protocol):
    elastic: bool  # it can place workers on new cores and release them (the planner may grow or shrink)

    def worker_ids(self) -> list[str]:
        """Every worker in the roster."""

    def spec(self, worker_id: str) -> WorkerSpec: ...

    def start_all(self, router_address: str) -> dict[str, WorkerProcess]:
        """Start every worker in the roster (the router calls it once it listens); worker id -> process."""

    def start(self, worker_id: str, router_address: str) -> WorkerProcess:
        """Start the worker's process (again, after a death: same id, role and cores); it joins the router."""

    def change_role(self, worker_id: str, role: str) -> str:
        """Hand a stopped worker's cores to a new worker of the role; its id (the old one is gone). Not started."""

    def add(self, role: str) -> str:
        """Elastic only: a new worker of the role on new cores; its id. Not started."""

    def release(self, worker_id: str) -> None:
        """Drop a stopped worker from the roster; its cores are free (on an elastic launcher, given back)."""

    def can_grow(self) -> bool:
        """Room for one worker more now (always False where not elastic)."""


@dataclass
class Roster(ABC):
    """The roster half of a launcher, shared by both: the specs and the edits the planner makes to them.
    A subclass adds start() and, if elastic, new_slot() and can_grow()."""

    specs: dict[str, WorkerSpec]  # worker id -> its spec

    elastic = False

    def worker_ids(self) -> list[str]:
        return list(self.specs)

    def spec(self, worker_id: str) -> WorkerSpec:
        return self.specs[worker_id]

    def start_all(self, router_address: str) -> dict[str, WorkerProcess]:
        return {worker_id: self.start(worker_id, router_address) for worker_id in self.specs}

    @abstractmethod
    def start(self, worker_id: str, router_address: str) -> WorkerProcess: ...

    def change_role(self, worker_id: str, role: str) -> str:
        return self._place(role, self.specs.pop(worker_id).cores)

    def add(self, role: str) -> str:
        if not self.elastic:
            raise NotImplementedError(f"{type(self).__name__} cannot place workers on new cores")
        return self._place(role, self.new_slot())

    def release(self, worker_id: str) -> None:
        del self.specs[worker_id]

    def can_grow(self) -> bool:
        return False

    def new_slot(self) -> list[int]:
        """The cores of a worker more (elastic launchers only)."""
        raise NotImplementedError

    def _place(self, role: str, cores: list[int]) -> str:
        # The lowest free index: a worker flipped back to its old role gets its old id again.
        worker_id = next(f"{role}-{i}" for i in range(len(self.specs) + 1) if f"{role}-{i}" not in self.specs)
        self.specs[worker_id] = WorkerSpec(role, cores)
        return worker_id


def roster(counts: dict[str, int], cores: list[list[int]]) -> dict[str, WorkerSpec]:
    """Worker ids role-0, role-1, ... in the order of counts (role -> workers), with the core sets in order."""
    roles = [role for role, n in counts.items() for _ in range(n)]
    index = dict.fromkeys(counts, 0)
    specs = {}
    for role, core_set in zip(roles, cores, strict=True):
        specs[f"{role}-{index[role]}"] = WorkerSpec(role, core_set)
        index[role] += 1
    return specs
