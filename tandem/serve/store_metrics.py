"""Prometheus series for the tiered KV store, per tier: what it served, saved, evicted and refused."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from tandem.kv.store.tier import TierStats

# TierStats field -> (metric name, help); the counters mirror the engines' running totals.
COUNTERS = {
    "hits": ("kv_store_hits", "KV blocks loaded from the store and verified, by tier."),
    "misses": ("kv_store_misses", "Store lookups or loads that found nothing usable, by tier."),
    "loaded_bytes": ("kv_store_loaded_bytes", "KV bytes loaded from the store, by tier."),
    "saved_bytes": ("kv_store_saved_bytes", "KV bytes saved into the store, by tier."),
    "evictions": ("kv_store_evictions", "Blocks evicted from the store for room, by tier."),
    "verify_failures": ("kv_store_verify_failures", "Stored blocks that did not verify (dropped, recomputed)."),
    "expired": ("kv_store_expired", "Stored blocks past their time to live, by tier."),
    "load_seconds": ("kv_store_load_seconds", "Time spent loading blocks, by tier (divide by hits: latency)."),
}
GAUGES = {
    "used_blocks": ("kv_store_used_blocks", "Blocks held by the tier."),
    "capacity_blocks": ("kv_store_capacity_blocks", "Blocks the tier can hold."),
}


class StoreMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        labels = ["model_name", "tier"]
        self.counters = {k: Counter(f"tandem:{n}", h, labels, registry=registry) for k, (n, h) in COUNTERS.items()}
        self.gauges = {k: Gauge(f"tandem:{n}", h, labels, registry=registry) for k, (n, h) in GAUGES.items()}
        self._last: dict[str, TierStats] = {}

    def observe(self, tiers: dict[str, TierStats]) -> None:
        for tier, s in tiers.items():
            before = self._last.get(tier, TierStats())
            for key, metric in self.counters.items():
                series = metric.labels(self.model_name, tier)  # exported from the start, at zero
                delta = getattr(s, key) - getattr(before, key)
                if delta > 0:
                    series.inc(delta)
            for key, metric in self.gauges.items():
                metric.labels(self.model_name, tier).set(getattr(s, key))
        self._last = dict(tiers)
