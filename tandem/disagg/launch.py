"""Start a disaggregated deployment's workers on this host, each pinned to its cores.

Local workers are the same `tandem worker` command a remote host runs: they connect to the
router's address with the shared secret from the environment, so there is one way to join.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

from tandem.disagg.wire import SECRET_ENV


def parse_cores(spec: str) -> list[int]:
    """'0', '0,1' or '2-3' -> a list of core ids."""
    cores: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        cores.extend(range(int(lo), int(hi or lo) + 1))
    return cores


def assign_cores(num_workers: int, specs: list[str] | None) -> list[list[int]]:
    """Explicit core sets per worker, or one core each, round-robin over the cores we may use."""
    if specs:
        if len(specs) != num_workers:
            raise ValueError(f"--worker-cores lists {len(specs)} core sets for {num_workers} workers")
        return [parse_cores(s) for s in specs]
    usable = sorted(os.sched_getaffinity(0))
    return [[usable[i % len(usable)]] for i in range(num_workers)]


def local_launcher(num_prefill: int, num_decode: int, core_specs: list[str] | None, engine_argv: list[str],
                   role_argv: dict[str, list[str]], kv_transport: str, secret: bytes, log_level: str
                   ) -> Callable[[str], list[subprocess.Popen]]:
    """engine_argv goes to every worker, then role_argv[role] (later flags win: each pool tuned for
    its phase, e.g. a larger token budget for prefill workers)."""
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    cores = assign_cores(len(roles), core_specs)

    def launch(router_address: str) -> list[subprocess.Popen]:
        env = {**os.environ, SECRET_ENV: secret.decode()}
        procs = []
        counts = {"prefill": 0, "decode": 0}
        for role, core_set in zip(roles, cores, strict=True):
            worker_id = f"{role}-{counts[role]}"
            counts[role] += 1
            argv = [sys.executable, "-m", "tandem.cli", "--log-level", log_level, "worker", "--role", role,
                    "--router", router_address, "--worker-id", worker_id, "--cores", ",".join(map(str, core_set)),
                    "--kv-transport", kv_transport, "--parent-pid", str(os.getpid()), *engine_argv,
                    *role_argv.get(role, [])]
            procs.append(subprocess.Popen(argv, env=env))
        return procs

    return launch
