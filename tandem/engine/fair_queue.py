"""The waiting queue: per-tenant queues in priority order, shared by virtual time over prompt tokens.

Each tenant (an API key, or whatever the server names) has its own queue ordered by
(priority, arrival), vLLM's meaning of `priority`: lower runs first. Tenants share the scheduler's
prompt-token budget by start-time fair queueing: a tenant's virtual time is the prompt tokens it
was given divided by its weight, the tenant furthest behind goes next, and a tenant that comes back
from idle starts at the busiest tenant's virtual time rather than with credit saved while it had
nothing to do. One tenant's flood of long prompts therefore cannot starve another's short chats, and
with a single tenant the order is plain priority-then-FCFS.
"""

from __future__ import annotations

import heapq
import itertools

from tandem.engine.request import Request


def order_key(request: Request) -> tuple[int, float]:
    """Queue order, vLLM's: lower priority values first, then earlier arrivals. Preemption takes the
    largest first."""
    return request.priority, request.arrival_time


class FairQueue:
    def __init__(self) -> None:
        self._queues: dict[str | None, list[tuple[int, float, int, Request]]] = {}
        self._vtime: dict[str | None, float] = {}
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, request: Request) -> None:
        """Queue a request (new, or preempted: it keeps its arrival, so it goes back near the front)."""
        self._queues.setdefault(request.tenant, [])
        heapq.heappush(self._queues[request.tenant], (*order_key(request), next(self._seq), request))
        self._len += 1

    def remove(self, request: Request) -> None:
        queue = self._queues[request.tenant]
        queue[:] = [e for e in queue if e[3] is not request]
        heapq.heapify(queue)
        self._len -= 1
        self._drop_if_empty(request.tenant)

    def head(self, tenant: str | None) -> Request | None:
        queue = self._queues.get(tenant)
        return queue[0][3] if queue else None

    def pop(self, tenant: str | None) -> Request:
        request = heapq.heappop(self._queues[tenant])[3]
        self._len -= 1
        self._drop_if_empty(tenant)
        return request

    def tenants(self) -> list[str | None]:
        return list(self._queues)

    # -- virtual time -------------------------------------------------------------------------
    def sync_active(self, active: set[str | None]) -> None:
        """Start tenants that just got prompt work at the least-served busy tenant's virtual time (no
        credit saved while idle), and forget tenants that have none (bounded memory)."""
        floor = min((v for t, v in self._vtime.items() if t in active), default=0.0)
        self._vtime = {t: self._vtime.get(t, floor) for t in active}

    def vtime(self, tenant: str | None) -> float:
        return self._vtime.get(tenant, 0.0)

    def charge(self, tenant: str | None, num_tokens: int, weight: float) -> None:
        self._vtime[tenant] = self._vtime.get(tenant, 0.0) + num_tokens / weight

    def _drop_if_empty(self, tenant: str | None) -> None:
        if not self._queues[tenant]:
            del self._queues[tenant]
