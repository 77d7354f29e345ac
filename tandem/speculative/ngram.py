"""Prompt lookup: the longest of the last max..min tokens that occurred earlier in the request
(prompt or output), and the tokens that followed its most recent occurrence."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.speculative.matching import TokenArray, suffix_matches
from tandem.speculative.proposer import NO_DRAFTS, Drafts, SpecRequest


class NgramProposer:
    def __init__(self, max_n: int, min_n: int) -> None:
        self.max_n, self.min_n = max_n, min_n
        self._history: dict[str, TokenArray] = {}

    def propose(self, requests: Sequence[SpecRequest], max_drafts: list[int]) -> list[Drafts]:
        out = []
        for request, k in zip(requests, max_drafts, strict=True):
            history = self._history.setdefault(request.request_id, TokenArray()).sync(request.all_token_ids)
            m, ends = suffix_matches(history, history, self.max_n)
            if k <= 0 or m < self.min_n:
                out.append(NO_DRAFTS)
                continue
            start = int(ends[-1])
            out.append(Drafts(history[start:start + k].tolist(), m))
        return out

    def finish(self, request: SpecRequest, completed: bool) -> None:
        self._history.pop(request.request_id, None)
