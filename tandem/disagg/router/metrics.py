"""Prometheus metrics of a disaggregated deployment, exported by the router next to the usual ones:
per worker (role, liveness, KV blocks, transfer bytes and times) and the router's own (reserve waits,
retries, colocated fallbacks, worker deaths). The router hands the exporter a ClusterSnapshot at each
scrape, and takes of the server's metrics only a MetricsSink: the registry, the model's name and the
collectors run before each render."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.disagg.router.registry import WorkerHandle
from tandem.disagg.router.settings import RouterCounters
from tandem.slo import LATENCY_BUCKETS


class MetricsSink(Protocol):
    """Where the router's series go: the server's metrics (serve/metrics.py's ServerMetrics) have this face."""

    @property
    def registry(self) -> CollectorRegistry: ...

    @property
    def model_name(self) -> str: ...

    @property
    def collectors(self) -> list[Callable[[], object]]:
        """Run before each render of the metrics page."""


@dataclass
class ClusterSnapshot:
    """What the exporter reads of the router at a scrape."""

    workers: Iterable[WorkerHandle]
    counters: RouterCounters  # its reserve waits and path records are drained by the exporter
    restarts: int
    planner_flips: dict[tuple[str, str], int] | None = None  # (from role, to role) -> flips; None: no planner
    planner_forecast_tok_s: float = 0.0
    # The predictive planner's last settled prediction: (predicted, measured) goodput, req/s.
    planner_goodput: tuple[float, float] | None = None


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        w = ["model_name", "worker", "role"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tandem:{name}", doc, w, registry=registry)

        def counter(name: str, doc: str, labels: list[str] = w) -> Counter:
            return Counter(f"tandem:{name}", doc, labels, registry=registry)

        self.up = gauge("worker_up", "1 while the worker heart-beats, 0 once it was declared dead.")
        self.used_blocks = gauge("worker_kv_cache_used_blocks", "KV blocks in use on the worker.")
        self.usage = gauge("worker_kv_cache_usage_perc", "Fraction of the worker's KV blocks in use (1 = full).")
        self.running = gauge("worker_num_requests_running", "Requests running on the worker.")
        self.waiting = gauge("worker_num_requests_waiting", "Requests waiting on the worker.")
        self.bytes_sent = counter("kv_transfer_sent_bytes", "KV bytes a prefill worker shipped.")
        self.bytes_received = counter("kv_transfer_received_bytes", "KV bytes a decode worker received by TCP "
                                      "(shared-memory writes land without the receiver's help).")
        self.transfers = counter("kv_transfers", "KV transfers finished, by outcome.", w + ["outcome"])
        self.transfer_s = counter("kv_transfer_seconds", "Transfer windows: first layer written to all landed.")
        self.hidden_s = counter("kv_transfer_hidden_seconds", "Transfer time overlapped with model compute.")
        self.exposed_s = counter("kv_transfer_exposed_seconds", "Transfer time added to the prefill's critical path.")
        self.reservations = counter("kv_reservations", "Blocks reservations a decode worker granted.")
        self.refused = counter("kv_reservations_refused", "Reservations refused for lack of free blocks.")
        r = ["model_name"]
        self.reserve_wait = Histogram("tandem:kv_reserve_wait_seconds", "Time a request waited for a decode "
                                      "worker's blocks.", r, buckets=LATENCY_BUCKETS, registry=registry)
        self.retries = counter("router_retries", "Disaggregated attempts retried after a failure.", r)
        self.fallbacks = counter("router_colocated_fallbacks", "Requests run whole on the least-loaded worker "
                                 "because no path could take them (failed transfers, or no worker to pick).", r)
        self.deaths = counter("router_worker_deaths", "Workers declared dead.", r)
        self.migrations = counter("router_migrations", "Decoding requests moved, KV and all, to another worker "
                                  "(a live migration).", r)
        self.restarts = counter("router_worker_restarts", "Dead local workers started again.", r)
        self.routed = counter("router_routed", "Requests routed, by path (disaggregated, colocated, prefill-free).",
                              r + ["path"])
        self.overlap = counter("router_routed_overlap_blocks", "Of the routed prompts' full blocks, those the "
                               "router found cached on the worker it chose (divide by prompt blocks: hit rate).",
                               r + ["worker_id"])
        self.prompt_blocks = counter("router_routed_prompt_blocks", "Full blocks of the prompts routed to a worker.",
                                     r + ["worker_id"])
        self.planner_flips = counter("router_planner_flips", "Workers the SLO planner moved from one pool to "
                                     "another.", r + ["from_role", "to_role"])
        self.requests = counter("router_routed_requests", "Requests routed to a worker (the one that computes the "
                                "prompt): the load each worker was given.", r + ["worker_id"])
        self.predicted: dict[str, Histogram] = {}
        self.measured: dict[str, Histogram] = {}
        for m, what in (("ttft", "time to first token"), ("tpot", "time per output token after the first")):
            self.predicted[m] = Histogram(f"tandem:router_predicted_{m}_seconds", f"The router's prediction of the "
                                          f"{what} on the path it chose, per finished request.", r + ["path"],
                                          buckets=LATENCY_BUCKETS, registry=registry)
            self.measured[m] = Histogram(f"tandem:router_measured_{m}_seconds", f"The {what} the router measured "
                                         "for the same requests.", r + ["path"], buckets=LATENCY_BUCKETS,
                                         registry=registry)
        self.forecast = Gauge("tandem:router_planner_forecast_prompt_tokens_per_second", "The SLO planner's "
                              "forecast of prompt tokens arriving per second over its next interval.", r,
                              registry=registry)
        self.goodput = {kind: Gauge(f"tandem:router_planner_{kind}_goodput", f"The predictive planner's last "
                                    f"settled prediction: the goodput (requests meeting both SLOs per second) {what} "
                                    "for the requests arriving over its horizon.", r, registry=registry)
                        for kind, what in (("predicted", "the simulator predicted"),
                                           ("measured", "then measured"))}
        self.prefill_free = counter("router_prefill_free", "Requests sent straight to a decode worker, which loads "
                                    "the prompt's KV from the store (all of it but the last block's tokens).", r)
        self._last: dict[tuple, float] = {}
        for metric in (self.retries, self.fallbacks, self.deaths, self.migrations, self.restarts, self.prefill_free,
                       self.reserve_wait, self.forecast):
            metric.labels(model_name)  # exported at zero from the start
        for src, dst in (("prefill", "decode"), ("decode", "prefill")):
            self.planner_flips.labels(model_name, src, dst)

    def _inc(self, counter: Counter, labels: tuple, value: float) -> None:
        """Counters mirror running totals reported elsewhere: add what is new since the last look."""
        key = (id(counter), *labels)
        delta = value - self._last.get(key, 0.0)
        series = counter.labels(*labels)  # exported from the first report, at zero
        if delta > 0:
            series.inc(delta)
        self._last[key] = value

    def collect(self, cluster: ClusterSnapshot) -> None:
        m = self.model_name
        for worker in cluster.workers:
            labels = (m, worker.worker_id, worker.role)
            self.up.labels(*labels).set(1 if worker.alive else 0)
            if worker.stats is None:
                continue
            core, t = worker.stats.core, worker.stats.transfer
            self.used_blocks.labels(*labels).set(core.num_used_blocks if worker.alive else 0)
            self.usage.labels(*labels).set(core.kv_usage if worker.alive else 0.0)
            self.running.labels(*labels).set(core.num_running if worker.alive else 0)
            self.waiting.labels(*labels).set(core.num_waiting if worker.alive else 0)
            for counter, value in ((self.bytes_sent, t.bytes_sent), (self.bytes_received, t.bytes_received),
                                   (self.transfer_s, t.transfer_s), (self.hidden_s, t.hidden_s),
                                   (self.exposed_s, t.exposed_s), (self.reservations, t.reservations),
                                   (self.refused, t.reservations_refused)):
                self._inc(counter, labels, value)
            self._inc(self.transfers, (*labels, "ok"), t.transfers_ok)
            self._inc(self.transfers, (*labels, "failed"), t.transfers_failed)
        c = cluster.counters
        waits, c.reserve_wait_s = c.reserve_wait_s, []
        for wait in waits:
            self.reserve_wait.labels(m).observe(wait)
        self._inc(self.retries, (m,), c.retries)
        self._inc(self.fallbacks, (m,), c.fallbacks)
        self._inc(self.deaths, (m,), c.worker_deaths)
        self._inc(self.migrations, (m,), c.migrations)
        self._inc(self.restarts, (m,), cluster.restarts)
        self._inc(self.prefill_free, (m,), c.prefill_free)
        if cluster.planner_flips is not None:
            for (src, dst), n in cluster.planner_flips.items():
                self._inc(self.planner_flips, (m, src, dst), n)
        for path, record in c.paths.items():
            for key, pred, meas in (("ttft", record.predicted_ttft_s, record.measured_ttft_s),
                                    ("tpot", record.predicted_tpot_s, record.measured_tpot_s)):
                for v in pred:
                    self.predicted[key].labels(m, path).observe(v)
                for v in meas:
                    self.measured[key].labels(m, path).observe(v)
                pred.clear()
                meas.clear()
        if cluster.planner_flips is not None:
            self.forecast.labels(m).set(cluster.planner_forecast_tok_s)
        if cluster.planner_goodput is not None:
            for kind, value in zip(("predicted", "measured"), cluster.planner_goodput, strict=True):
                self.goodput[kind].labels(m).set(value)
        for wid, n in c.requests.items():
            self._inc(self.requests, (m, wid), n)
        for path, n in c.routed.items():
            self._inc(self.routed, (m, path), n)
        for wid, n in c.prompt_blocks.items():
            self._inc(self.prompt_blocks, (m, wid), n)
            self._inc(self.overlap, (m, wid), c.overlap_blocks.get(wid, 0))
