"""Start a disaggregated deployment's workers on this host, each pinned to its cores.

Local workers are the same `tandem worker` command a remote host runs: they connect to the
router's address with the shared secret from the environment, so there is one way to join.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from tandem.disagg.fleet.launcher import Roster, roster
from tandem.disagg.worker.wire import SECRET_ENV


def parse_cores(spec: str) -> list[int]:
    """'0', '0,1' or '2-3' -> a list of core ids."""
    cores: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def assign_cores(num_workers: int, specs: list[str] | None) -> list[list[int]]:
    """Explicit core sets per worker, or one core each, round-robin over the cores we may use."""
    usable = sorted(os.sched_getaffinity(0))
    if specs:
        if len(specs) != num_workers:
            raise ValueError(f"--worker-cores lists {len(specs)} core sets for {num_workers} workers")
        try:
            sets = [parse_cores(s) for s in specs]
        except ValueError:
            raise ValueError(f"--worker-cores {' '.join(specs)}: give core ids like 0, 0,1 or 2-3") from None
        missing = sorted({c for s in sets for c in s} - set(usable))
        if missing:
            raise ValueError(f"--worker-cores: cores {missing} are not among this process's {usable}")
        return sets
    return [[usable[i % len(usable)]] for i in range(num_workers)]


@dataclass
class LocalLauncher(Roster):
    """Starts this host's workers (the launcher interface, launcher.py) and starts a dead one again, with
    the same id, role and cores. engine_argv goes to every worker, then role_argv[role] (later flags
    win: each pool tuned for its phase, e.g. a larger token budget for prefill workers). Not elastic:
    the planner only moves a worker's cores to the other pool."""

    engine_argv: list[str]
    role_argv: dict[str, list[str]]
    kv_transport: str
    secret: bytes
    log_level: str

    def start(self, worker_id: str, router_address: str) -> subprocess.Popen:
        spec = self.specs[worker_id]
        argv = [sys.executable, "-m", "tandem.cli", "--log-level", self.log_level, "worker", "--role", spec.role,
                "--router", router_address, "--worker-id", worker_id, "--cores", ",".join(map(str, spec.cores)),
                "--kv-transport", self.kv_transport, "--parent-pid", str(os.getpid()), *self.engine_argv,
                *self.role_argv.get(spec.role, [])]
        return subprocess.Popen(argv, env={**os.environ, SECRET_ENV: self.secret.decode()})


def local_launcher(num_prefill: int, num_decode: int, core_specs: list[str] | None, engine_argv: list[str],
                   role_argv: dict[str, list[str]], kv_transport: str, secret: bytes, log_level: str,
                   num_colocated: int = 0) -> LocalLauncher:
    cores = assign_cores(num_prefill + num_decode + num_colocated, core_specs)
    specs = roster({"prefill": num_prefill, "decode": num_decode, "colocated": num_colocated}, cores)
    return LocalLauncher(specs, engine_argv, role_argv, kv_transport, secret, log_level)
