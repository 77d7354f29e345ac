"""Workers as Ray actors: `tandem serve --ray [ADDRESS]` places each worker in a placement group of
its own (Ray picks the host), and the router sees each actor as it sees a local worker process (pid,
poll, wait, kill: launcher.py's WorkerProcess), so death detection, restarts and the planner's role
flips work unchanged; being elastic, the planner may also add workers and release them.

Ray is optional (the `ray` extra); nothing here is imported unless --ray is given. KV moves between
hosts over the ZeroMQ transport (each decode actor binds its receiver on its node's address); tokens
stream back through the router as with local workers.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass
from typing import Any

from tandem.disagg.fleet.launcher import Roster, roster

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
        from tandem.config import EngineConfig
        from tandem.disagg.worker.cluster_worker import run_worker
        from tandem.engine.args import add_engine_args, engine_kwargs

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
class RayLauncher(Roster):
    """The launcher interface (launcher.py) over Ray, elastic: a spec's cores are a list as long as its
    CPU count (the planner moves that list to the worker that takes the role over), and a worker more
    gets cpus_per_worker of them where the cluster has room."""

    engine_argv: list[str]
    role_argv: dict[str, list[str]]
    secret: bytes
    log_level: str
    placement_timeout_s: float = 120.0
    cpus_per_worker: int = 1
    # Where decode actors bind their KV receivers: None, their node's address; a router bound to
    # loopback (one host) keeps them on loopback too.
    kv_host: str | None = None

    elastic = True

    def can_grow(self) -> bool:
        """Room on the cluster for one more worker (the planner may then add one)."""
        return _ray().available_resources().get("CPU", 0.0) >= self.cpus_per_worker

    def new_slot(self) -> list[int]:
        return list(range(self.cpus_per_worker))

    def start(self, worker_id: str, router_address: str) -> RayWorkerProcess:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.specs[worker_id]
        cpus = max(len(spec.cores), 1)
        group = placement_group([{"CPU": cpus}], strategy="STRICT_PACK", name=f"tandem-{worker_id}")
        ready, _ = ray.wait([group.ready()], timeout=self.placement_timeout_s)
        if not ready:
            raise RuntimeError(f"Ray could not place {worker_id} ({cpus} CPU) in {self.placement_timeout_s:.0f} s")
        actor = _actor_class().options(num_cpus=cpus, name=None, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=group)).remote()
        pid = ray.get(actor.pid.remote())
        argv = [*self.engine_argv, *self.role_argv.get(spec.role, [])]
        run_ref = actor.run.remote(argv, spec.role, router_address, self.secret, worker_id, cpus, self.log_level,
                                   self.kv_host)
        log.warning("worker %s (%s) placed as a Ray actor, pid %d", worker_id, spec.role, pid)
        return RayWorkerProcess(actor, group, run_ref, pid)


def ray_launcher(num_prefill: int, num_decode: int, num_colocated: int, cpus_per_worker: int, engine_argv: list[str],
                 role_argv: dict[str, list[str]], secret: bytes, log_level: str,
                 kv_host: str | None = None) -> RayLauncher:
    counts = {"prefill": num_prefill, "decode": num_decode, "colocated": num_colocated}
    specs = roster(counts, [list(range(cpus_per_worker)) for _ in range(sum(counts.values()))])
    return RayLauncher(specs, engine_argv, role_argv, secret, log_level, cpus_per_worker=cpus_per_worker,
                       kv_host=kv_host)
