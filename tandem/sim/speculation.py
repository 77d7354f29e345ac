"""Speculative decoding, simulated: a stream's decode row carries drafts, verified in one step, and
keeps the accepted ones plus the target's own token.

What a proposer drafts depends on the text, which the simulator does not have; what the live server
counts of it does (its spec_decode_* counters): how often a decode row carried drafts, how many, and
how often each position was accepted. `SpecModel.from_counters` turns those into the draw the
simulator makes per row: a draft with probability `draft_rate`, of `draft_tokens` tokens, position
i accepted with probability `accept[i]` given the ones before it were (a rejection ends the run).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SpecModel:
    draft_tokens: int
    accept: tuple[float, ...]  # per position, given every earlier one accepted
    draft_rate: float = 1.0  # of decode rows that carry drafts

    def __post_init__(self) -> None:
        if self.draft_tokens < 1:
            raise ValueError("a draft has at least one token")
        if not 0.0 <= self.draft_rate <= 1.0 or not all(0.0 <= a <= 1.0 for a in self.accept):
            raise ValueError("the draft rate and the acceptance are probabilities")

    def acceptance(self, position: int) -> float:
        if not self.accept:
            return 0.0
        return self.accept[min(position, len(self.accept) - 1)]

    def mean_accepted(self) -> float:
        """Tokens accepted per verification, in expectation."""
        total, reach = 0.0, 1.0
        for i in range(self.draft_tokens):
            reach *= self.acceptance(i)
            total += reach
        return total

    def draw_accepted(self, rng: np.random.Generator, num_drafted: int) -> int:
        for i in range(num_drafted):
            if rng.random() >= self.acceptance(i):
                return i
        return num_drafted

    @classmethod
    def parse(cls, draft_tokens: int, accept: str, draft_rate: float = 1.0) -> SpecModel:
        """accept: one probability for every position, or one per position, comma-separated."""
        try:
            values = tuple(float(a) for a in accept.split(",") if a.strip())
        except ValueError:
            raise ValueError(f"the acceptance is probabilities, comma-separated, got {accept!r}") from None
        return cls(draft_tokens, values, draft_rate)

    @classmethod
    def from_counters(cls, num_drafts: float, num_draft_tokens: float, accepted_per_pos: Sequence[float],
                      num_decode_rows: float) -> SpecModel | None:
        """From a run's counters: verifications, draft tokens verified, tokens accepted at each position,
        and decode rows (output tokens computed one row at a time: every output token but the first and
        the accepted drafts). None when nothing was drafted."""
        if num_drafts <= 0 or num_draft_tokens <= 0:
            return None
        draft_tokens = max(1, round(num_draft_tokens / num_drafts))
        accept, reached = [], float(num_drafts)
        for pos in range(draft_tokens):
            got = float(accepted_per_pos[pos]) if pos < len(accepted_per_pos) else 0.0
            accept.append(min(got / reached, 1.0) if reached > 0 else 0.0)
            reached = got
        rate = min(num_drafts / num_decode_rows, 1.0) if num_decode_rows > 0 else 1.0
        return cls(draft_tokens, tuple(accept), rate)
