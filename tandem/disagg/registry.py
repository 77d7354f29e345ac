"""The router's view of its workers: what it knows of each, and their engine stats summed."""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field

from tandem.disagg.worker import WorkerInfo, WorkerStats
from tandem.serve.core_proc import CoreStats
from tandem.serve.store_metrics import merge_tier_stats


@dataclass
class WorkerHandle:
    info: WorkerInfo
    ident: bytes
    last_seen: float = field(default_factory=time.monotonic)
    stats: WorkerStats | None = None
    alive: bool = True
    inflight: set[str] = field(default_factory=set)
    proc: subprocess.Popen | None = None
    joined: float = field(default_factory=time.monotonic)
    draining: bool = False  # the planner is taking it out of its pool: no new requests

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def role(self) -> str:
        return self.info.role

    @property
    def load(self) -> float:
        """Requests assigned and not finished, plus the engine's own queue, as last reported."""
        queued = self.stats.core.num_waiting if self.stats is not None else 0
        return len(self.inflight) + queued


def combined_stats(workers: list[WorkerHandle]) -> CoreStats | None:
    """The deployment's engine stats: the sum over the workers that have reported (None: none has)."""
    parts = [w.stats.core for w in workers if w.stats is not None]
    if not parts:
        return None
    blocks = sum(s.num_blocks for s in parts)
    used = sum(s.num_used_blocks for s in parts)
    return CoreStats(
        sum(s.num_running for s in parts), sum(s.num_waiting for s in parts), used / blocks if blocks else 0.0,
        used, blocks, *(sum(getattr(s, f) for s in parts) for f in (
            "num_preemptions", "prefix_queries", "prefix_hits", "num_prompt_tokens", "num_generation_tokens")),
        time.monotonic(), sum(s.prompt_busy_s for s in parts), sum(s.num_computed_prompt_tokens for s in parts),
        merge_tier_stats([s.kv_store for s in parts]))
