"""Instances that share one host: what a neighbour's step does to a step's time.

On a CPU host, workers pinned to their own cores still share the last-level cache and the memory
bandwidth: a decode step (bandwidth-bound) slows while the next core prefills, and a prefill slows
less while the next core decodes. `tandem profile` measures it (colocation_profile.py): the slowdown of its
own prefill and decode steps while a neighbour process on the other cores runs prefills, then
decodes. The simulator runs a host's in-flight steps at 1 / (1 + Σ slowdown[own][theirs]) of their
speed, re-pricing each whenever a neighbour starts or ends a step (processor sharing).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("prefill", "decode")


def step_kind(num_tokens: int, num_decode: int) -> str:
    """A step computing any prompt tokens is compute-bound like a prefill; one of single-token rows
    only reads weights and KV."""
    return "decode" if num_tokens == num_decode else "prefill"


@dataclass
class Neighbours:
    """slowdown[own][theirs]: the fraction a step of kind `own` takes longer while one neighbour
    runs a step of kind `theirs` (0.25: 25% longer); measured, never negative."""

    slowdown: dict[str, dict[str, float]] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)  # how it was measured (steps, medians)

    def factor(self, own: str, theirs: Iterable[str]) -> float:
        """How many times longer a step of kind `own` takes beside these neighbours' steps."""
        row = self.slowdown.get(own, {})
        return 1.0 + sum(max(row.get(t, 0.0), 0.0) for t in theirs)

    def to_json(self) -> dict[str, Any]:
        return {"slowdown": self.slowdown, "meta": self.meta}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Neighbours | None:
        if not d:
            return None
        return cls({own: {t: float(v) for t, v in row.items()} for own, row in d["slowdown"].items()},
                   d.get("meta", {}))
