"""Several KV connectors as one: a worker that loads from the store and sends to a decode worker, or
sends and receives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.connectors.base import FinishedTransfers, KVConnector
from tandem.engine.request import Request
from tandem.engine.step import ConnectorMeta, ScheduledRequest
from tandem.kv.pool import KVPool


@dataclass
class MultiMeta(ConnectorMeta):
    parts: list[ConnectorMeta | None]  # each connector's plan, in the connectors' order


class MultiConnector(KVConnector[MultiMeta]):
    """Several connectors in order: the first that can load a request's tokens loads them; every
    one sees every step and every finished request."""

    def __init__(self, connectors: list[KVConnector]) -> None:
        self.connectors = connectors
        self._owner: dict[str, KVConnector] = {}  # who is loading a request

    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        for c in self.connectors:
            n = c.num_loadable_tokens(request, num_computed_tokens)
            if n:
                self._owner[request.request_id] = c
                return n
        return 0

    def on_allocated(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                     num_external_tokens: int) -> None:
        self._owner[request.request_id].on_allocated(request, block_ids, num_computed_tokens, num_external_tokens)

    def take_finished(self) -> FinishedTransfers:
        out = FinishedTransfers()
        for c in self.connectors:
            out.update(c.take_finished())
        return out

    def on_load_finished(self, request: Request, num_loaded_tokens: int) -> None:
        owner = self._owner.pop(request.request_id, None)
        if owner is not None:
            owner.on_load_finished(request, num_loaded_tokens)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._owner.pop(request.request_id, None)
        return any([c.request_finished(request, block_ids) for c in self.connectors])  # every one is told

    def build_step(self, items: list[ScheduledRequest]) -> MultiMeta:
        return MultiMeta([c.build_step(items) for c in self.connectors])

    def busy(self) -> bool:
        return any(c.busy() for c in self.connectors)

    def wait(self, timeout: float) -> None:
        for c in self.connectors:
            if c.busy():
                c.wait(timeout)
                return

    def reset(self, request_id: str) -> None:
        for c in self.connectors:
            c.reset(request_id)

    def register_kv_caches(self, pool: KVPool) -> None:
        for c in self.connectors:
            c.register_kv_caches(pool)

    def start_step(self, meta: MultiMeta | None) -> None:
        parts = meta.parts if meta is not None else [None] * len(self.connectors)
        for c, m in zip(self.connectors, parts, strict=True):
            c.start_step(m)

    def wait_for_layer_load(self, layer: int) -> None:
        for c in self.connectors:
            c.wait_for_layer_load(layer)

    def save_layer(self, layer: int) -> None:
        for c in self.connectors:
            c.save_layer(layer)

    def finish_step(self) -> None:
        for c in self.connectors:
            c.finish_step()

    @property
    def has_layer_work(self) -> bool:
        return any(c.has_layer_work for c in self.connectors)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in self.connectors:
            out.update(c.stats())
        return out

    def close(self) -> None:
        for c in self.connectors:
            c.close()
