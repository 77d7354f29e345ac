"""The router's settings and the running totals it keeps for its metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.restart_backoff import MAX_RESTART_BACKOFF_S, RESTART_BACKOFF_S


@dataclass
class RouterSettings:
    bind: str = "tcp://127.0.0.1:0"
    secret: bytes = b""
    expected_workers: int = 0  # wait for this many (and at least one) to register before serving
    startup_timeout: float = 300.0
    heartbeat_timeout: float = 5.0
    reserve_timeout: float = 10.0  # how long a request waits for a decode worker's blocks
    prefill_timeout: float = 300.0
    max_attempts: int = 2  # disaggregated tries before running the request colocated
    migrate: bool = True  # a worker the planner retires hands what it decodes over, KV and all
    # A dead local worker is started again by the restart backoff (tandem/restart_backoff.py).
    restart_backoff_s: float = RESTART_BACKOFF_S
    max_restart_backoff_s: float = MAX_RESTART_BACKOFF_S
    # Every worker's prefix-cache events, published again on this ZeroMQ PUB address (None: not at all),
    # each batch with the id of the worker it came from.
    kv_events_endpoint: str | None = None


@dataclass
class PathRecord:
    """Per path: what the router predicted for its requests and what they measured."""

    predicted_ttft_s: list[float] = field(default_factory=list)  # drained by the metrics exporter
    measured_ttft_s: list[float] = field(default_factory=list)
    predicted_tpot_s: list[float] = field(default_factory=list)
    measured_tpot_s: list[float] = field(default_factory=list)

    def record(self, predicted_ttft_s: float | None, ttft_s: float | None, predicted_tpot_s: float | None,
               tpot_s: float | None) -> None:
        """A finished request's predictions beside what it measured (each pair where both exist)."""
        if ttft_s is not None and predicted_ttft_s is not None:
            self.predicted_ttft_s.append(predicted_ttft_s)
            self.measured_ttft_s.append(ttft_s)
        if tpot_s is not None and predicted_tpot_s is not None:
            self.predicted_tpot_s.append(predicted_tpot_s)
            self.measured_tpot_s.append(tpot_s)


@dataclass
class RouterCounters:
    reserve_wait_s: list[float] = field(default_factory=list)  # drained by the metrics exporter
    retries: int = 0
    fallbacks: int = 0
    migrations: int = 0  # decoding requests moved, KV and all, to another worker
    worker_deaths: int = 0
    disaggregated: int = 0
    colocated: int = 0
    prefill_free: int = 0  # sent straight to a decode worker: the store held all of the prompt but its tail
    routed: dict[str, int] = field(default_factory=dict)  # path (disaggregated, colocated, ...) -> requests
    overlap_blocks: dict[str, int] = field(default_factory=dict)  # worker id -> cached blocks of routed prompts
    prompt_blocks: dict[str, int] = field(default_factory=dict)  # worker id -> full blocks of routed prompts
    requests: dict[str, int] = field(default_factory=dict)  # worker id -> requests routed to it
    paths: dict[str, PathRecord] = field(default_factory=dict)
    transfers: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict)  # (prefill, decode) -> n, bytes

    def count_route(self, path: str, worker_id: str, overlap: int, num_blocks: int) -> None:
        self.routed[path] = self.routed.get(path, 0) + 1
        self.overlap_blocks[worker_id] = self.overlap_blocks.get(worker_id, 0) + overlap
        self.prompt_blocks[worker_id] = self.prompt_blocks.get(worker_id, 0) + num_blocks
        self.requests[worker_id] = self.requests.get(worker_id, 0) + 1

    def count_transfer(self, prefill_id: str, decode_id: str, num_bytes: int) -> None:
        n, total = self.transfers.get((prefill_id, decode_id), (0, 0))
        self.transfers[(prefill_id, decode_id)] = (n + 1, total + num_bytes)

    def path(self, name: str) -> PathRecord:
        return self.paths.setdefault(name, PathRecord())
