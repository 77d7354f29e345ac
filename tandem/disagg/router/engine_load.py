"""What admission weighs a request against, as the server's side of an engine sees it: the requests in
flight (Load), the engine's measured step shape, and which prompt blocks the engine likely caches.
EngineClient (engine_client.py) builds on these; the router (disagg_engine.py) says which blocks its
workers cache (cached_blocks)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from tandem.engine.core_report import CoreInfo, CoreStats
from tandem.engine.core_request import EngineCoreRequest
from tandem.kv.hashing import block_keys
from tandem.policy.admission import Load, PromptRate, predict_wait
from tandem.policy.deadlines import EngineShape, Flights


@dataclass
class Stream:
    """A request in flight as the server counts it: its queue of outputs and its progress."""

    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_output: bool = False
    consuming: bool = False  # someone iterates; if nobody ever does, the entry goes when it finishes
    tenant: str | None = None
    prompt_tokens: int = 0
    num_seqs: int = 1
    tokens_left: int = 0  # of its longest sample, at most: when its seat frees up
    last_output: float = 0.0
    tokens_done: int = 0  # streamed so far (of its longest sample)
    first_at: float = 0.0  # when its first token came
    created: float = 0.0
    predicted_ttft_s: float = 0.0  # admission's prediction when it was enqueued (0: none)
    deadline: float = float("inf")  # when its timeout ends (monotonic clock; inf: none)
    requests: list[EngineCoreRequest] = field(default_factory=list)  # as sent: sent again if the engine restarts


class EngineLoad:
    """The load and speed views of an EngineClient (its fields, set by EngineClient.__init__)."""

    info: CoreInfo | None
    stats: CoreStats | None
    streams: dict[str, Stream]
    prompt_rate: PromptRate
    token_gap_s: float
    step_budget: int

    def capacity(self) -> int:
        """Sequences the engine runs at once."""
        raise NotImplementedError

    def shape(self) -> EngineShape | None:
        """The engine's measured step times and limits, for deadline predictions (None: none measured)."""
        raise NotImplementedError

    def _block_keys(self, prompt_ids: list[int], salt: str | None) -> list[int]:
        info = self.info
        if info is None:
            return []
        return block_keys(prompt_ids, info.block_size, info.hash_algo, info.block_key_extra, salt)

    def cached_blocks(self, keys: list[int]) -> int:
        """Of a prompt's full blocks, how many from the first the engine likely caches."""
        raise NotImplementedError

    def uncached_tokens(self, prompt_ids: list[int], salt: str | None) -> int:
        """The prompt's tokens the engine would compute: its blocks likely in the prefix cache are not
        work (the last token is always computed)."""
        keys = self._block_keys(prompt_ids, salt)
        cached = self.cached_blocks(keys) * self.info.block_size if keys and self.info is not None else 0
        return max(len(prompt_ids) - cached, 1)

    def _predicted_ttft(self, tenant: str | None, prompt_tokens: int, num_seqs: int) -> float:
        """What admission predicts for a request enqueued now, before calibration, so that its first
        token can correct the next predictions."""
        return predict_wait(self.capacity(), self.load(tenant), num_seqs, prompt_tokens, self.prompt_rate.rate,
                            self.shape()).ttft_s

    def load(self, tenant: str | None) -> Load:
        """What admission control weighs a new request against."""
        in_flight = waiting = queued = tenant_waiting = tenant_queued = 0
        others: set[str | None] = set()
        active: set[str | None] = set()
        frees: list[float] = []
        rows: list[tuple[int, int, int, int, float]] = []
        now = time.monotonic()
        for s in self.streams.values():
            rows.append((s.num_seqs, 0 if s.first_output else s.prompt_tokens, s.tokens_left, s.tokens_done,
                         now - s.first_at if s.first_output else 0.0, s.deadline - now))
            in_flight += s.num_seqs
            frees += [s.tokens_left * self.token_gap_s] * s.num_seqs
            if s.tenant != tenant:
                active.add(s.tenant)
            if not s.first_output:
                waiting += 1
                queued += s.prompt_tokens
                if s.tenant == tenant:
                    tenant_waiting += 1
                    tenant_queued += s.prompt_tokens
                else:
                    others.add(s.tenant)
        return Load(in_flight, waiting, queued, tenant_waiting, tenant_queued, len(others), sorted(frees),
                    Flights.of(rows), len(active))
