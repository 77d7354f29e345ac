"""The KV connector: the one seam through which KV moves into and out of a worker's pool.

Prefill/decode disaggregation (KV sent to another worker as it is computed, or received from one)
and the tiered KV store (blocks saved below the pool and loaded back instead of recomputed) are
both connectors; the scheduler and the runner know only this interface. It has two halves:

Scheduler half (called by `Scheduler`, once per decision):
  - `num_loadable_tokens`: how many tokens beyond the pool's own prefix hits the connector can bring
    in. The scheduler then allocates blocks for them and the request waits in WAITING_FOR_KV, holding
    its blocks but no seat, while everyone else's steps go on;
  - `on_allocated`: the blocks are allocated; the connector starts bringing the KV into them;
  - `take_finished`: loads that finished (and how many tokens each brought, maybe fewer than asked:
    a block that did not verify is recomputed) and requests whose blocks may now be freed;
  - `on_load_finished`: a load's KV is in place; the connector may advance the request (a decode
    worker appends the token its prefill worker sampled; a store hit counts as cached tokens);
  - `request_finished`: a request ends; True keeps its blocks until `take_finished` releases them
    (something may still be reading or writing them);
  - `build_step`: the step's plan for the worker half (a ConnectorMeta of the connector's own
    type, engine/step.py), from the scheduled requests.

Worker half (called by `ModelRunner`, around the forward pass):
  - `register_kv_caches`: the pool, once (kv/pool.py: every KV head, a worker group's ranks' too);
  - `start_step`: the step's plan, before the forward pass;
  - `wait_for_layer_load`: before layer i runs (a connector loading layer by layer blocks here);
  - `save_layer`: layer i's KV is in the pool (sent or saved while layer i+1 computes);
  - `finish_step`: after the forward pass (whole-block saves happen here).

One class holds both halves: the scheduler and the runner share a process here, and each half's
methods touch only that half's state. `MultiConnector` (multi.py) runs several (a prefill worker
that loads from the store and sends to a decode worker).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tandem.engine.request import Request
from tandem.engine.step import ConnectorMeta, ScheduledRequest
from tandem.kv.pool import KVPool

MetaT = TypeVar("MetaT", bound=ConnectorMeta)


@dataclass
class FinishedTransfers:
    loads: dict[str, int] = field(default_factory=dict)  # request id -> tokens loaded and in place
    released: set[str] = field(default_factory=set)  # finished requests whose blocks may be freed now

    def update(self, other: FinishedTransfers) -> None:
        for rid, n in other.loads.items():
            self.loads[rid] = min(self.loads.get(rid, n), n)
        self.released |= other.released


class KVConnector(Generic[MetaT]):
    """The null connector: the pool is all there is. Subclasses override what they use; MetaT is
    the type of the per-step plan that build_step makes and start_step reads."""

    # -- scheduler half -------------------------------------------------------------------------
    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0

    def on_allocated(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                     num_external_tokens: int) -> None:
        pass

    def take_finished(self) -> FinishedTransfers:
        return FinishedTransfers()

    def on_load_finished(self, request: Request, num_loaded_tokens: int) -> None:
        pass

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        return False

    def build_step(self, items: list[ScheduledRequest]) -> MetaT | None:
        return None

    def busy(self) -> bool:
        """Work in flight that finishes on its own (not on a message from outside): the engine keeps
        polling while it has no step to run."""
        return False

    def wait(self, timeout: float) -> None:
        """Block up to timeout for in-flight work to progress (an engine with nothing to step)."""

    def reset(self, request_id: str) -> None:
        """The request's last step was undone (it is computed again): forget what it did."""

    # -- worker half ----------------------------------------------------------------------------
    def register_kv_caches(self, pool: KVPool) -> None:
        pass

    def start_step(self, meta: MetaT | None) -> None:
        pass

    def wait_for_layer_load(self, layer: int) -> None:
        pass

    def save_layer(self, layer: int) -> None:
        pass

    def finish_step(self) -> None:
        pass

    @property
    def has_layer_work(self) -> bool:
        """Whether the forward pass must call wait_for_layer_load / save_layer this step."""
        return False

    def stats(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass
