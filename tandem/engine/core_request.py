"""A request as it crosses a process boundary: the API process or a router to an engine, a router to
a worker. What the client asked for and who it belongs to, never the scheduler's progress.

Frozen: the sender keeps its copy (to send again after a restart, or to another worker) and sends it
as it is; the engine builds its own mutable `Request` (request.py) on arrival, as vLLM's engine core
builds its Request from an EngineCoreRequest. Slotted, so a message pickles as its values, without
the scheduler's state (a Request also carries every token again, block hashes and timings).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # the model's end tokens (LoadedModel.end_token_ids)
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # vLLM's meaning: lower is served (and kept from preemption) first
    # Who the request belongs to (an API key's id, or a header the operator names) and its share of
    # the prompt-token budget against other tenants with work.
    tenant: str | None = None
    tenant_weight: float = 1.0
    # A stored conversation's handle: when the request finishes, its blocks stay cached under it until
    # released (ReleaseKV), so that the conversation's next turn finds its whole history cached.
    retain_kv_as: str | None = None
    # Output the request already has (a live migration's target: all but the newest token, whose KV
    # arrives computed with the prompt's).
    output_token_ids: tuple[int, ...] = ()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
