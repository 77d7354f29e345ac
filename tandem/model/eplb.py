"""Expert placement for expert parallelism: which expert each slot of each rank holds, and EPLB's
rebalancing (DeepSeek's expert-parallel load balancer, in its simplest form: one level, no groups).

A placement is a list over the group's global slots (rank r's slot j is r * slots + j) of the
logical expert each holds, or -1 for an empty spare slot. Every rank computes the same placement
from the same (all-reduced) loads, so no placement is ever sent.
"""

from __future__ import annotations

import torch

from tandem.model.tensor_parallel import split_range

Placement = list[int]


def initial_placement(num_experts: int, ranks: int, slots: int) -> Placement:
    """Each rank's contiguous share of the experts in its first slots; spare slots empty."""
    placement = [-1] * (ranks * slots)
    for r in range(ranks):
        e0, e1 = split_range(num_experts, ranks, r)
        placement[r * slots:r * slots + e1 - e0] = range(e0, e1)
    return placement


def rebalance(loads: list[float], ranks: int, slots: int) -> Placement:
    """A placement for these per-expert loads: every expert once, the spare slots given to replicas of
    the experts with the most load per replica, then the replicas dealt to ranks heaviest first, each to
    the least-loaded rank with a free slot that does not already hold that expert (where one exists)."""
    num_experts = len(loads)
    replicas = [1] * num_experts
    for _ in range(ranks * slots - num_experts):
        hot = max(range(num_experts), key=lambda e: (loads[e] / replicas[e], -e))
        replicas[hot] += 1
    items = sorted(((loads[e] / replicas[e], e) for e in range(num_experts) for _ in range(replicas[e])),
                   key=lambda it: (-it[0], it[1]))
    rank_load = [0.0] * ranks
    held: list[list[int]] = [[] for _ in range(ranks)]
    for load, e in items:
        free = [r for r in range(ranks) if len(held[r]) < slots]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += load
    placement = [-1] * (ranks * slots)
    for r in range(ranks):
        placement[r * slots:r * slots + len(held[r])] = held[r]
    return placement


def replica_table(placement: Placement, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [E, max replicas]: each expert's global slots, padded with its first; count [E])."""
    where: list[list[int]] = [[] for _ in range(num_experts)]
    for slot, e in enumerate(placement):
        if e >= 0:
            where[e].append(slot)
    if any(not w for w in where):
        raise ValueError("a placement must hold every expert")
    width = max(len(w) for w in where)
    # On the CPU explicitly: a model is built under the meta device (the loader), then materialised.
    table = torch.tensor([w + [w[0]] * (width - len(w)) for w in where], dtype=torch.int64, device="cpu")
    return table, torch.tensor([len(w) for w in where], dtype=torch.int64, device="cpu")


def rank_loads(placement: Placement, loads: list[float], ranks: int, slots: int) -> list[float]:
    """Each rank's share of the load when an expert's tokens are spread evenly over its replicas."""
    count = [0] * len(loads)
    for e in placement:
        if e >= 0:
            count[e] += 1
    out = [0.0] * ranks
    for slot, e in enumerate(placement):
        if e >= 0:
            out[slot // slots] += loads[e] / count[e]
    return out
