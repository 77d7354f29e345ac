"""`GET /v1/cluster`: the deployment as one JSON document, for the dashboard and for scripts.

The engine client says what the deployment is (engine.cluster(): its mode, router, workers, KV
transfers between them, planner actions); this adds what the API layer measured (the latency
window and its time series, from ServerMetrics.live) and the totals, so that the colocated server
and the router answer with one schema (SCHEMA_VERSION; README "Dashboard" documents the fields).
"""

from __future__ import annotations

import time
from typing import Any

import tandem
from tandem.engine.core_report import CoreInfo, CoreStats
from tandem.engine.worker_view import rate as _rate
from tandem.slo import Slo

SCHEMA_VERSION = 1
WINDOW_S = 60.0  # the headline percentiles: the last minute


def store_tiers(stats: CoreStats | None, info: CoreInfo | None) -> list[dict[str, Any]]:
    if stats is None:
        return []
    block = info.block_nbytes if info is not None else 0
    return [{"tier": name, "used_blocks": t.used_blocks, "capacity_blocks": t.capacity_blocks,
             "used_bytes": t.used_blocks * block, "capacity_bytes": t.capacity_blocks * block,
             "usage": t.used_blocks / t.capacity_blocks if t.capacity_blocks else 0.0,
             "hits": t.hits, "misses": t.misses, "hit_rate": _rate(t.hits, t.hits + t.misses),
             "loaded_bytes": t.loaded_bytes, "saved_bytes": t.saved_bytes, "evictions": t.evictions}
            for name, t in stats.kv_store.items()]


def totals(stats: CoreStats | None) -> dict[str, Any]:
    s = stats
    if s is None:
        return {"running": 0, "waiting": 0, "kv_usage": 0.0, "kv_used_blocks": 0, "kv_total_blocks": 0,
                "prefix_hit_rate": None, "prompt_tokens": 0, "generation_tokens": 0, "preemptions": 0}
    return {"running": s.num_running, "waiting": s.num_waiting, "kv_usage": s.kv_usage,
            "kv_used_blocks": s.num_used_blocks, "kv_total_blocks": s.num_blocks,
            "prefix_hit_rate": _rate(s.prefix_hits, s.prefix_queries), "prompt_tokens": s.num_prompt_tokens,
            "generation_tokens": s.num_generation_tokens, "preemptions": s.num_preemptions}


def snapshot(engine: Any, metrics: Any, model: str, slo: Slo | None, started_at: float) -> dict[str, Any]:
    """engine: an EngineClient; metrics: the server's ServerMetrics."""
    live = metrics.live
    view = engine.cluster()
    return {"object": "cluster", "schema_version": SCHEMA_VERSION, "version": tandem.__version__, "model": model,
            "time": time.time(), "uptime_s": time.time() - started_at, "health": engine.health(),
            "slo": None if slo is None else {"ttft_ms": slo.ttft_s * 1000, "tpot_ms": slo.tpot_s * 1000},
            **view, "totals": totals(engine.stats), "store": store_tiers(engine.stats, engine.info),
            "window": live.window(WINDOW_S), "bucket_s": live.bucket_s, "series": live.series()}
