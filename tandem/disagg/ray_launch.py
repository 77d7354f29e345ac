"""Workers as Ray actors: `tandem serve --ray [ADDRESS]` places each worker in a placement group of
its own (Ray picks the host), and the router sees each actor as it sees a local worker process (pid,
poll, wait, kill), so death detection, restarts and the planner's role flips work unchanged.

Ray is optional (the `ray` extra); nothing here is imported unless --ray is given. KV moves between
hosts over the ZeroMQ transport (each decode actor binds its receiver on its node's address); tokens
stream back through the router as with local workers.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError("--ray needs Ray: pip install 'tandem[ray]' (or ray itself)") from None
    return ray


def node_address() -> str:
    """This process's node as the cluster knows it (the address its raylet was started with: a head
    on 127.0.0.1 keeps everything on loopback), not whatever interface the host routes out of."""
    ray = _ray()
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return str(node["NodeManagerAddress"])
    return ray.util.get_node_ip_address()


def connect(address: str | None) -> str:
    """Join the Ray cluster at address ("auto": the one this host belongs to); this node's address."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address or "auto", logging_level=logging.WARNING, log_to_driver=False)
    return node_address()


class WorkerActor:
    """The actor's body: a `tandem worker` in the actor's process (made a Ray actor in `_actor_class`)."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, engine_argv: list[str], role: str, router: str, secret: bytes, worker_id: str, num_cpus: int,
            log_level: str, kv_host: str | None) -> int:
        import argparse

        from tandem import logs
        from tandem.engine.args import add_engine_args, engine_kwargs
        from tandem.config import EngineConfig
        from tandem.disagg.worker import run_worker

        logs.setup(log_level, process=worker_id)
        parser = argparse.ArgumentParser()
        add_engine_args(parser)
        args = parser.parse_args(engine_argv)
        args.num_threads = num_cpus  # the CPUs Ray reserved for it, not the host's
        config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
        return run_worker(config, role, router, secret, worker_id, None, "zmq", kv_host or node_address())


_actor_cls: Any = None


def _actor_class() -> Any:
    global _actor_cls
    if _actor_cls is None:
        _actor_cls = _ray().remote(WorkerActor)
    return _actor_cls


class RayWorkerProcess:
    """A worker actor with the face of a subprocess.Popen (what the router polls, waits for and kills)."""

    def __init__(self, actor: Any, group: Any, run_ref: Any, pid: int) -> None:
        self.actor, self.group, self.run_ref, self.pid = actor, group, run_ref, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            ray = _ray()
            ready, _ = ray.wait([self.run_ref], timeout=0)
            if ready:
                try:
                    self.returncode = int(ray.get(ready[0]) or 0)
                except Exception:  # the actor died (killed, or its process crashed)
                    self.returncode = 1
                self._release()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ray = _ray()
        ready, _ = ray.wait([self.run_ref], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired(f"ray actor (pid {self.pid})", timeout or 0)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        _ray().kill(self.actor, no_restart=True)
        self.poll()
        self._release()

    def _release(self) -> None:
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


@dataclass
class RayLauncher:
    """The local launcher's interface (roles, start, called with the router's address) over Ray.
    roles maps a worker id to (role, a list as long as its CPU count): the planner moves that list
    to the worker that takes the role over."""

    roles: dict[str, tuple[str, list[int]]]
    engine_argv: list[str]
    role_argv: dict[str, list[str]]
    secret: bytes
    log_level: str
    placement_timeout_s: float = 120.0
    procs: list[RayWorkerProcess] = field(default_factory=list)
    cpus_per_worker: int = 1
    # Where decode actors bind their KV receivers: None, their node's address; a router bound to
    # loopback (one host) keeps them on loopback too.
    kv_host: str | None = None

    def can_grow(self) -> bool:
        """Room on the cluster for one more worker (the planner may then add one)."""
        return _ray().available_resources().get("CPU", 0.0) >= self.cpus_per_worker

    def new_slot(self) -> list[int]:
        return list(range(self.cpus_per_worker))

    def __call__(self, router_address: str) -> list[RayWorkerProcess]:
        return [self.start(worker_id, router_address) for worker_id in self.roles]

    def start(self, worker_id: str, router_address: str) -> RayWorkerProcess:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        role, cpu_slots = self.roles[worker_id]
        cpus = max(len(cpu_slots), 1)
        group = placement_group([{"CPU": cpus}], strategy="STRICT_PACK", name=f"tandem-{worker_id}")
        ready, _ = ray.wait([group.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise RuntimeError(f"Ray could not place {worker_id} ({cpus} CPU) in {self.placement_timeout_s:.0f} s")
        actor = _actor_class().options(num_cpus=cpus, name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group)).remote()
        pid = ray.get(actor.pid.remote())
        argv = [*self.engine_argv, *self.role_argv.get(role, [])]
        run_ref = actor.run.remote(argv, role, router_address, self.secret, worker_id, cpus, self.log_level,
                                   self.kv_host)
        log.warning("worker %s (%s) placed as a Ray actor, pid %d", worker_id, role, pid)
        proc = RayWorkerProcess(actor, group, run_ref, pid)
        self.procs.append(proc)
        return proc


def ray_launcher(num_prefill: int, num_decode: int, num_colocated: int, cpus_per_worker: int, engine_argv: list[str],
                 role_argv: dict[str, list[str]], secret: bytes, log_level: str,
                 kv_host: str | None = None) -> RayLauncher:
    roles: dict[str, tuple[str, list[int]]] = {}
    for role, n in (("prefill", num_prefill), ("decode", num_decode), ("colocated", num_colocated)):
        for i in range(n):
            roles[f"{role}-{i}"] = (role, list(range(cpus_per_worker)))
    return RayLauncher(roles, engine_argv, role_argv, secret, log_level, cpus_per_worker=cpus_per_worker,
                       kv_host=kv_host)
