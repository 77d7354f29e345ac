"""Prometheus metrics, named in parallel to vLLM's with a `tandem:` prefix."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from tandem.engine.core_report import CoreInfo, CoreStats
from tandem.serve.live_stats import LiveStats
from tandem.serve.store_metrics import StoreMetrics
from tandem.slo import LATENCY_BUCKETS, Slo

disable_created_metrics()  # as vLLM does: the *_created series only add noise

PREDICTION_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


@dataclass
class RequestTimer:
    """Per-request timestamps kept by the API layer (its own clock, where the client waits)."""

    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


class ServerMetrics:
    def __init__(self, model_name: str, slo: Slo | None = None) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"tandem:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"tandem:{name}", doc, labels + list(extra), registry=r)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"tandem:{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=r)

        self.running = gauge("num_requests_running", "Requests running in the engine this step.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV blocks in use.")
        self.kv_total_blocks = gauge("kv_cache_total_blocks", "KV blocks in the pool.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens received by the engine.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.preemptions = counter("num_preemptions", "Requests preempted for lack of KV blocks.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.success = counter("request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.rejected = counter("request_rejected", "Requests refused (queue full).")
        self.goodput = counter("request_goodput", "Finished requests that met both SLOs (--slo-ttft-ms, "
                               "--slo-tpot-ms): their rate is the goodput.")
        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output chunks.")
        self.tpot = hist("request_time_per_output_token_seconds", "Mean time per output token after the first.")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("request_queue_time_seconds", "Time from arrival to first scheduling.")
        self.ttft_prediction = Histogram(
            "tandem:admission_ttft_prediction_ratio", "Admission's predictor: an admitted request's first token as "
            "it came over its prediction (1 = exact; the calibration corrects the next predictions by it).",
            labels, buckets=PREDICTION_RATIO_BUCKETS, registry=r)
        self.weight_bytes = Gauge("tandem:model_weight_bytes", "Bytes of the weights as one engine holds them, "
                                  "by linear method (gguf-Q4_1: 4-bit blocks as stored).", ["model_name", "formats"],
                                  registry=r)
        self.kv_bytes_per_token = gauge("kv_cache_bytes_per_token", "Bytes of one token's KV, every layer.")
        self.spec_drafts = counter("spec_decode_num_drafts", "Verifications of a request's speculative drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Speculative draft tokens verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Speculative draft tokens accepted, by position (0: the first draft).",
                                             ("position",))
        self.expert_imbalance = Gauge("tandem:expert_load_imbalance", "Expert parallelism: max / mean rows per "
                                      "rank in a sparse layer's last load window (1 = even).",
                                      ["model_name", "layer"], registry=r)
        self.expert_rebalances = counter("expert_rebalances", "Expert placements EPLB made (all sparse layers).")
        self._last: CoreStats | None = None
        self.store = StoreMetrics(r, model_name)
        self.collectors: list = []  # callables run before each render (the router's per-worker metrics)
        self.slo = slo
        self.live = LiveStats(slo)  # the last minutes, for the dashboard
        # Export every series from the start (at zero) rather than only once it first moves.
        for metric in (self.running, self.waiting, self.kv_usage, self.kv_used_blocks, self.kv_total_blocks,
                       self.prompt_tokens, self.generation_tokens, self.preemptions, self.prefix_queries,
                       self.prefix_hits, self.rejected, self.goodput, self.spec_drafts, self.spec_draft_tokens,
                       self.spec_accepted):
            metric.labels(model_name)

    def observe_core(self, s: CoreStats | None) -> None:
        if s is None:
            return
        m = self.model_name
        self.running.labels(m).set(s.num_running)
        self.waiting.labels(m).set(s.num_waiting)
        self.kv_usage.labels(m).set(s.kv_usage)
        self.kv_used_blocks.labels(m).set(s.num_used_blocks)
        self.kv_total_blocks.labels(m).set(s.num_blocks)
        prev = self._last
        # Counters mirror the core's running totals: add the difference since the last look.
        for metric, now, before in (
            (self.prompt_tokens, s.num_prompt_tokens, prev.num_prompt_tokens if prev else 0),
            (self.generation_tokens, s.num_generation_tokens, prev.num_generation_tokens if prev else 0),
            (self.preemptions, s.num_preemptions, prev.num_preemptions if prev else 0),
            (self.prefix_queries, s.prefix_queries, prev.prefix_queries if prev else 0),
            (self.prefix_hits, s.prefix_hits, prev.prefix_hits if prev else 0),
            (self.spec_drafts, s.spec_num_drafts, prev.spec_num_drafts if prev else 0),
            (self.spec_draft_tokens, s.spec_num_draft_tokens, prev.spec_num_draft_tokens if prev else 0),
            (self.spec_accepted, s.spec_num_accepted_tokens, prev.spec_num_accepted_tokens if prev else 0),
            (self.expert_rebalances, s.expert_rebalances, prev.expert_rebalances if prev else 0),
        ):
            if now > before:
                metric.labels(m).inc(now - before)
        before_pos = prev.spec_accepted_per_pos if prev else []
        for pos, now in enumerate(s.spec_accepted_per_pos):
            before = before_pos[pos] if pos < len(before_pos) else 0
            if now > before:
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(now - before)
        for layer, imbalance in enumerate(s.expert_imbalance):
            self.expert_imbalance.labels(m, str(layer)).set(imbalance)
        self.store.observe(s.kv_store)
        self._last = s

    def observe_ttft_prediction(self, predicted_s: float, actual_s: float) -> None:
        self.ttft_prediction.labels(self.model_name).observe(actual_s / predicted_s)

    def observe_chunk(self, timer: RequestTimer, num_new_tokens: int) -> None:
        now = time.monotonic()
        if timer.first_token is None:
            timer.first_token = now
            self.ttft.labels(self.model_name).observe(now - timer.arrival)
        elif timer.last_token is not None and num_new_tokens:
            self.itl.labels(self.model_name).observe(now - timer.last_token)
            self.live.token_gap(now - timer.last_token)
        self.live.tokens(num_new_tokens)
        timer.last_token = now
        timer.num_tokens += num_new_tokens

    def observe_finish(self, timer: RequestTimer, reason: str | None, queue_time: float | None) -> None:
        m = self.model_name
        now = time.monotonic()
        self.success.labels(m, reason or "abort").inc()
        self.e2e.labels(m).observe(now - timer.arrival)
        if queue_time is not None:
            self.queue.labels(m).observe(max(queue_time, 0.0))
        tpot = (now - timer.first_token) / (timer.num_tokens - 1) \
            if timer.first_token is not None and timer.num_tokens > 1 else None
        if tpot is not None:
            self.tpot.labels(m).observe(tpot)
        ttft = timer.first_token - timer.arrival if timer.first_token is not None else None
        ok = reason not in (None, "abort")
        if ok and (self.slo is None or self.slo.met(ttft, tpot)):
            self.goodput.labels(m).inc()
        self.live.finished(ttft, tpot, ok, max(queue_time, 0.0) if queue_time is not None else None)

    def observe_info(self, info: CoreInfo | None) -> None:
        if info is not None and info.weight_bytes:
            self.weight_bytes.labels(self.model_name, ",".join(info.weight_formats)).set(info.weight_bytes)
            self.kv_bytes_per_token.labels(self.model_name).set(info.kv_bytes_per_token)

    def render(self, stats: CoreStats | None, info: CoreInfo | None = None) -> bytes:
        self.observe_core(stats)
        self.observe_info(info)
        for collect in self.collectors:
            collect()
        return generate_latest(self.registry)
