"""What rank 0 of a worker group broadcasts to its followers (engine/worker_group.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.kv.pool import SharedPart
from tandem.model.attention import AttentionMetadata


@dataclass(frozen=True)
class PoolSpec:
    """Rank 0's KV pool, which every rank mirrors in its own share of the KV heads."""

    num_blocks: int
    # Each rank's part, allocated by rank 0 in shared memory (kv/pool.py); None: each rank allocates its own.
    parts: list[SharedPart | None] | None = None


@dataclass(frozen=True)
class StepInputs:
    """A step's packed inputs: every rank runs the same forward on them."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor


@dataclass(frozen=True)
class Stop:
    """The group is closing: followers exit."""
