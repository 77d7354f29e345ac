"""A scheduled step, as the scheduler hands it to the runner and the KV connector: which requests
compute how many new tokens into which blocks, and the connector's plan for the step; and the
scheduler's counters after it (SchedulerStats). Below both the scheduler and the connector, so that
neither imports the other for it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import Request


@dataclass
class ConnectorMeta:
    """A KV connector's plan for one step: its scheduler half builds it from the scheduled requests
    (`build_step`), its worker half carries it out around the forward pass (`start_step`). Each
    connector subclasses it with what its worker half needs."""


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the KV manager's live list (KVCacheManager.block_ids): read it this step, never keep it


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    connector_meta: ConnectorMeta | None = None  # the KV connector's plan for this step (its worker half runs it)
    # Requests whose blocks were freed since the last step (finished, aborted, preempted): the runner
    # drops what it kept for them (their block-table rows).
    freed_request_ids: list[str] = field(default_factory=list)
    # The single-token rows come first in `scheduled` (the scheduler orders them so), so the runner
    # need not sort them there.
    decodes_first: bool = False

    @property
    def total_num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    num_used_blocks: int
    num_blocks: int
    num_waiting_prompt_tokens: int
    num_decoding: int
