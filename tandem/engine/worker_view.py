"""One engine's entry in a deployment's view (`GET /v1/cluster`'s `workers`), from its CoreStats.

Both engine clients build these (the colocated server's one core, the router's workers), so the
schema lives here, below both of them.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from tandem.engine.core_report import CoreStats


def rate(hits: float, queries: float) -> float | None:
    return hits / queries if queries else None


def worker_entry(worker_id: str, role: str, state: str, pid: int | None, host: str, cores: list[int] | None,
                 stats: CoreStats | None, **extra: Any) -> dict[str, Any]:
    """One engine of the deployment; state: up, draining, starting or dead."""
    s = stats
    entry: dict[str, Any] = {"id": worker_id, "role": role, "state": state, "pid": pid, "host": host,
                             "cores": cores}
    if s is None:
        entry |= {"running": 0, "waiting": 0, "kv_used_blocks": 0, "kv_total_blocks": 0, "kv_usage": 0.0,
                  "prefix_hit_rate": None, "prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0}
    else:
        up = state != "dead"
        entry |= {"running": s.num_running if up else 0, "waiting": s.num_waiting if up else 0,
                  "kv_used_blocks": s.num_used_blocks if up else 0, "kv_total_blocks": s.num_blocks,
                  "kv_usage": s.kv_usage if up else 0.0, "prefix_hit_rate": rate(s.prefix_hits, s.prefix_queries),
                  "prompt_tokens": s.num_prompt_tokens, "generation_tokens": s.num_generation_tokens,
                  "preemptions": s.num_preemptions}
    return entry | extra


def process_cores(pid: int | None) -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(pid)) if pid else None
    except OSError:  # gone, or another host's
        return None


def host_name() -> str:
    return socket.gethostname()
