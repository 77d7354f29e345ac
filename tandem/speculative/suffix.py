"""Suffix decoding (Arctic Inference's method, arXiv 2411.04975), model-free.

Two histories are searched for the longest suffix of the request's tokens: the request's own
tokens (its prompt and output), and the outputs of the tenant's recently finished requests. From
each match the proposal follows the most frequent continuation for as long as its estimated
probability stays above min_token_prob, and for at most max_spec_factor x the match length tokens
(a long match earns a long guess); match plus continuation stay within max_tree_depth tokens, as
in a suffix tree of that depth (the match is cut to leave room for the drafts asked for). Of the
two proposals the one with more tokens expected to be accepted is taken.

Requests of one tenant (and cache salt) share a history; nothing crosses tenants. A shared history
is bounded by max_cached_requests sequences and MAX_SHARED_TOKENS tokens, oldest dropped, and at
most MAX_TENANTS are kept.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np

from tandem.speculative.matching import SEP, TokenArray, frequent_continuation, suffix_matches
from tandem.speculative.proposer import NO_DRAFTS, Drafts, SpecRequest

MAX_SHARED_TOKENS = 1 << 16  # per tenant: what one search of the shared history scans at most
MAX_TENANTS = 256  # shared histories kept (least recently finished into dropped first)


class SharedOutputs:
    """A tenant's recent outputs, one array with SEP after each, the oldest dropped first."""

    def __init__(self, max_sequences: int, max_tokens: int = MAX_SHARED_TOKENS) -> None:
        self.max_sequences, self.max_tokens = max_sequences, max_tokens
        self.tokens = TokenArray(1024)
        self._lengths: deque[int] = deque()

    def add(self, output: list[int]) -> None:
        output = output[-(self.max_tokens - 1):]
        if not output:
            return
        self.tokens.extend([*output, SEP])
        self._lengths.append(len(output) + 1)
        drop = 0
        while len(self._lengths) > self.max_sequences or self.tokens.size - drop > self.max_tokens:
            drop += self._lengths.popleft()
        if drop:
            self.tokens.drop_front(drop)


class SuffixProposer:
    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float,
                 min_token_prob: float) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._own: dict[str, TokenArray] = {}
        self._shared: OrderedDict[tuple[str | None, str | None], SharedOutputs] = OrderedDict()

    def propose(self, requests: Sequence[SpecRequest], max_drafts: list[int]) -> list[Drafts]:
        out = []
        for request, k in zip(requests, max_drafts, strict=True):
            own = self._own.setdefault(request.request_id, TokenArray()).sync(request.all_token_ids)
            if k <= 0:
                out.append(NO_DRAFTS)
                continue
            pattern = own[-(self.max_depth - 1):]
            best, best_expected = NO_DRAFTS, 0.0
            shared = self._shared.get((request.tenant, request.cache_salt))
            for history in (own, shared.tokens.view if shared else None):
                if history is None:
                    continue
                drafts, expected = self._from(history, pattern, k)
                if expected > best_expected:
                    best, best_expected = drafts, expected
            out.append(best)
        return out

    def _from(self, history: np.ndarray, pattern: np.ndarray, k: int) -> tuple[Drafts, float]:
        # The match leaves the tree's depth room for k drafts: a long copy's match would otherwise
        # fill it (Arctic's speculation likewise weighs shorter matches with longer continuations).
        m, ends = suffix_matches(history, pattern, max(self.max_depth - k, 1))
        limit = min(k, self.max_depth - m, int(self.max_spec_factor * m))
        if m == 0 or limit <= 0:
            return NO_DRAFTS, 0.0
        tokens, expected = frequent_continuation(history, ends, limit, self.min_token_prob)
        return Drafts(tokens, m), expected

    def finish(self, request: SpecRequest, completed: bool) -> None:
        self._own.pop(request.request_id, None)
        if self.max_cached_requests > 0 and completed and request.output_token_ids:
            key = (request.tenant, request.cache_salt)
            shared = self._shared.get(key)
            if shared is None:
                shared = self._shared[key] = SharedOutputs(self.max_cached_requests)
                if len(self._shared) > MAX_TENANTS:
                    self._shared.popitem(last=False)
            self._shared.move_to_end(key)
            shared.add(request.output_token_ids)
