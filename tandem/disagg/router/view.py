"""A cluster router's part of GET /v1/cluster (serve/cluster_view.py adds the totals; the dashboard
draws it): the router, its workers (state, cores, load, what was routed there, KV bytes moved), the
transfers between them and the planner's view."""

from __future__ import annotations

import os
from typing import Any

from tandem.disagg.router.metrics import ClusterSnapshot
from tandem.disagg.router.planner_loop import PlannerLoop
from tandem.disagg.router.registry import WorkerRegistry
from tandem.disagg.router.settings import RouterCounters
from tandem.engine.worker_view import host_name, worker_entry


def cluster_view(registry: WorkerRegistry, c: RouterCounters, address: str, in_flight: int, restarts: int,
                 planning: PlannerLoop | None) -> dict[str, Any]:
    workers = []
    for w in registry.workers.values():
        if w.draining and not w.alive:
            continue  # retired by the planner: its cores went to another worker
        state = "dead" if not w.alive else ("draining" if w.draining else "up")
        t = w.stats.transfer if w.stats is not None else None
        blocks = c.prompt_blocks.get(w.worker_id, 0)
        workers.append(worker_entry(
            w.worker_id, w.role, state, w.info.pid, w.info.host, w.info.cores,
            w.stats.core if w.stats is not None else None, in_flight=len(w.inflight),
            kv_total_blocks=w.info.core.num_blocks,  # known from its Register, before its first report
            requests_routed=c.requests.get(w.worker_id, 0),
            routed_overlap_rate=c.overlap_blocks.get(w.worker_id, 0) / blocks if blocks else None,
            kv_bytes_sent=t.bytes_sent if t else 0, kv_bytes_received=t.bytes_received if t else 0))
    router = {"id": "router", "address": address, "pid": os.getpid(), "host": host_name(),
              "in_flight": in_flight, "routed": dict(c.routed), "retries": c.retries,
              "fallbacks": c.fallbacks, "worker_deaths": c.worker_deaths, "restarts": restarts}
    transfers = [{"from": src, "to": dst, "count": n, "bytes": nbytes}
                 for (src, dst), (n, nbytes) in sorted(c.transfers.items())]
    planner = planning.view() if planning is not None else None
    # Colocated: every worker runs whole requests (the single server's lone worker, or several).
    split = any(w.role in ("prefill", "decode") for w in registry.workers.values())
    return {"mode": "disaggregated" if split else "colocated", "router": router, "workers": workers,
            "transfers": transfers, "planner": planner}


def cluster_snapshot(registry: WorkerRegistry, c: RouterCounters, restarts: int,
                     planning: PlannerLoop | None) -> ClusterSnapshot:
    """What the router's metrics export: its workers, counters, restarts and the planner's forecasts."""
    p = planning
    settled = p.planner.predictions.last_settled() if p is not None else None
    goodput = (settled.predicted_rps, settled.measured_rps or 0.0) if settled is not None else None
    return ClusterSnapshot(registry.workers.values(), c, restarts, p.flips if p is not None else None,
                           p.planner.last_forecast_tok_s if p else 0.0, goodput)


def cluster_health(registry: WorkerRegistry, healthy: bool, dead: str | None) -> dict[str, Any]:
    """ok, degraded (a role has no live worker: requests still run, colocated) or unhealthy."""
    reasons = [f"no live {role} worker" for role in sorted({w.role for w in registry.workers.values()})
               if not registry.live(role)]
    if not healthy:
        return {"status": "unhealthy", "reasons": reasons or [dead or "no live workers"]}
    return {"status": "degraded" if reasons else "ok", "reasons": reasons}
