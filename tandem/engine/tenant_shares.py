"""How many prompt tokens each tenant may take in one step (the scheduler's caps).

While other tenants have requests in the engine (prompts, or streams decoding), each takes at most its
weight's share of the step's prompt budget, and the heaviest at most contended_prefill_chunk tokens
(the others in proportion): a flood's chunks stay small enough that another tenant's next prompt, or
next token, never waits behind a long step. A tenant alone takes everything.

A tenant seen within RECENT_TENANT_ROUNDS keeps its share reserved: a client between two requests
(its last answer sent, its next one not yet here) must not find a flood's full-budget step in front
of it, a second or more on a busy machine. Counted in scheduling rounds, not seconds, so the
scheduler stays a function of its inputs (the simulator replays it).
"""

from __future__ import annotations

from tandem.config import SchedulerConfig

# About 0.5-1.5 s of 128-token steps on a 2-core machine.
RECENT_TENANT_ROUNDS = 8


class TenantShares:
    def __init__(self, config: SchedulerConfig, block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        # Tenants that had requests here lately: weight, and the round last seen in.
        self._recent: dict[str | None, tuple[float, int]] = {}
        self._rounds = 0

    def caps(self, weights: dict[str | None, float]) -> dict[str | None, int]:
        """This round's prompt-token cap of every tenant with requests here (weights: their shares)."""
        self._rounds += 1
        for tenant, weight in weights.items():
            self._recent[tenant] = (weight, self._rounds)
        present = dict(weights)
        for tenant, (weight, seen) in list(self._recent.items()):
            if self._rounds - seen > RECENT_TENANT_ROUNDS:
                del self._recent[tenant]
            elif tenant not in present:
                present[tenant] = weight
        budget = self.config.max_num_batched_tokens
        if len(present) <= 1 or not self.config.enable_chunked_prefill:
            return dict.fromkeys(weights, budget)
        total = sum(present.values())
        chunk = (self.config.contended_prefill_chunk or budget) / max(present.values())
        return {t: max(int(min(budget / total, chunk) * w), self.block_size) for t, w in weights.items()}
