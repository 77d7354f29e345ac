"""Stored responses (`store: true`, the default): each with what a follow-up needs to append only its
new tokens (the conversation's messages and token ids), what GET returns, and its tenant, so that no
other tenant can read, continue or delete it. Bounded: the least recently used response goes first."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    tenant: str | None  # the cache salt of the key that made it (None: no API keys)
    body: dict[str, Any]  # the response object, as returned
    input_items: list[dict[str, Any]]  # this turn's input items, as given (GET .../input_items)
    messages: list[dict[str, Any]]  # the whole conversation so far, as template messages, the reply included
    system: list[dict[str, Any]]  # the instructions' system message it was rendered with (or none)
    token_ids: list[int] | None  # the prompt and the reply, up to its end token (None: it did not end so)
    salt: str | None  # the prefix cache's salt its tokens were cached under


class ResponseStore:
    def __init__(self, max_stored: int) -> None:
        self.max_stored = max_stored
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, stored: StoredResponse) -> list[str]:
        """Keep a response; the ids of those it pushed out (least recently used first)."""
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        evicted = []
        while len(self._items) > self.max_stored:
            evicted.append(self._items.popitem(last=False)[0])
        return evicted

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """The response, if it exists and is this tenant's (another's is as absent as a missing one)."""
        stored = self._items.get(response_id)
        if stored is None or stored.tenant != tenant:
            return None
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str, tenant: str | None) -> bool:
        if self.get(response_id, tenant) is None:
            return False
        del self._items[response_id]
        return True

    def __len__(self) -> int:
        return len(self._items)
