"""What rank 0 of a worker group broadcasts to its followers (engine/worker_group.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.model.attention import AttentionMetadata


@dataclass(frozen=True)
class PoolSpec:
    """Rank 0's KV pool, which every rank mirrors in its own share of the KV heads."""

    num_blocks: int


@dataclass(frozen=True)
class StepInputs:
    """A step's packed inputs: every rank runs the same forward on them."""

    input_ids: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    # Blocks whose KV every rank contributes its heads of after each layer (a KV connector sends them
    # from rank 0: a disaggregated prefill); None: no gathers this step.
    gather_blocks: torch.Tensor | None = None


@dataclass(frozen=True)
class Stop:
    """The group is closing: followers exit."""
